# The maxshard trainer image, for GKE workloads submitted with `python -m maxshard.launch xpk` (docs/launch.md).
#
#   docker build --build-arg ACCELERATOR=tpu -t REGION-docker.pkg.dev/PROJECT/REPO/maxshard:TAG .
#
# ACCELERATOR picks JAX's backend: tpu (jax[tpu], libtpu from PyPI), cuda (jax[cuda12]) or cpu (plain jax).
FROM python:3.11-slim

ARG ACCELERATOR=tpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Only what the package and its runs need: copying the whole directory would pull in .venv/ and runs/.
COPY pyproject.toml README.md ./
COPY maxshard ./maxshard
COPY configs ./configs

# The import check runs from / so that it loads the installed package, not /app/maxshard.
RUN case "$ACCELERATOR" in \
        tpu) extra="[tpu]" ;; \
        cuda) extra="[cuda]" ;; \
        cpu) extra="" ;; \
        *) echo "ACCELERATOR must be tpu, cuda or cpu, got '$ACCELERATOR'" >&2; exit 1 ;; \
    esac \
    && pip install ".${extra}" \
    && cd / && python -c "import maxshard.train"

# XPK runs its --command in this directory, so `configs/base.yml` resolves.
CMD ["python", "-m", "maxshard.train", "configs/base.yml"]
