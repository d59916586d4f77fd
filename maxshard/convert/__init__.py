"""Hugging Face checkpoints in and out: `python -m maxshard.convert from_hf|to_hf ...` (see __main__.py).

    families.py        the supported families, one row of data each (q/k norm, MoE names and fields, ...)
    hf_config.py       config.json <-> maxshard model keys; refuses what the model cannot represent
    names.py           the tensor name and layout table, as data
    layout.py          maxshard's parameter tree for given model keys, joined with the table
    safetensors_io.py  Hugging Face checkpoint directories through the safetensors package: rows in, shards out
    orbax_io.py        the orbax step directory, written and read one slice at a time
    from_hf.py, to_hf.py  the two directions
"""
