"""Loading a run: config -> processes -> devices -> plan -> model (loading), keeping a checkpoint's global batch
on the devices that came back (elastic), confirming the remat policy with the compiled step (compile_check), and
loading every candidate layout of a config for a target we do not have (search). The entry points start here."""
