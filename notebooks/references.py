"""Remake the stored references `agentrl-jax compare` checks a run against
(agentrl_jax/reproduce/references/*.json; see agentrl_jax/reproduce/compare.py).

    python notebooks/references.py [--models-from RESULTS]

- ``frozenlake_default_avx512.json``: the fingerprint of ``results_cpu_default/`` (the built-in
  default on the AMD EPYC with AVX-512). The stored folder holds no models; with
  ``--models-from RESULTS`` (a run of the same config on a CPU with the same deciding features
  and jax version, every compared file of which equals the stored folder's) their hashes are
  added from it.
- ``frozenlake_default_avx2.json``: Table 1 of ``results_cpu_default_avx2/`` (see its
  README.md), with today's default config and no bytes or verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from agentrl_jax.reproduce import compare

HERE = Path(__file__).resolve().parent


def avx512(models_from: Path | None) -> compare.Reference:
    stored = compare.fingerprint(
        HERE / "results_cpu_default",
        name="frozenlake-default-avx512",
        source="notebooks/results_cpu_default (2026-12-06)",
    )
    if models_from is None:
        return stored
    run = compare.fingerprint(models_from)
    check = compare.compare(run, stored)
    if not check.reproduced or (run.features, run.jax) != (stored.features, stored.jax):
        raise SystemExit(f"{models_from} is not the stored run: {check}")
    models = {f: h for f, h in run.files.items() if f.startswith("models/")}
    return dataclasses.replace(stored, files={**stored.files, **models})


def avx2(default_config: str) -> compare.Reference:
    folder = HERE / "results_cpu_default_avx2"
    return compare.Reference(
        name="frozenlake-default-avx2",
        made_on="Intel(R) Xeon(R) Processor (GenuineIntel family 6 model 167; avx2 fma; "
        "2 cores, x86_64), 1 x cpu; jax 0.10.2, jaxlib 0.10.2",
        features=(),
        jax="0.10.2",
        config_sha256=default_config,
        files={},
        table1=compare.table1_cells((folder / "table1.csv").read_text()),
        verdicts={},
        source="notebooks/results_cpu_default_avx2 (2026-12-04, at 476dc35; Table 1 only, "
        "the same on an AMD EPYC without AVX-512 at 0e88d12)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-from", type=Path, default=None)
    args = parser.parse_args()
    first = avx512(args.models_from)
    for ref, name in ((first, "avx512"), (avx2(first.config_sha256), "avx2")):
        path = compare.REFERENCES / f"frozenlake_default_{name}.json"
        path.write_text(ref.to_json())
        print(
            f"{path}: {len(ref.files)} files, {len(ref.table1)} Table 1 rows, "
            f"{len(ref.verdicts)} verdicts"
        )


if __name__ == "__main__":
    main()
