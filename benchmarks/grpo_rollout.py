"""GRPO's rollout time against its step time through the CLI, tiny and 125m presets, 8 CPU devices.

    python benchmarks/grpo_rollout.py [--models tiny,125m] [--steps 6] [--new-tokens 32] [key=value ...]

Each model trains `--steps` GRPO steps (`maxshard.train`, one rollout a step: grpo_updates_per_rollout 1) on byte
prompts with a reward that asks for digits, logging every step. From metrics.jsonl, over the steps after the first
(which compiles) and before the last (timed without a rollout after it): the median iteration time
(`step_time`: the rollout, the old log-probabilities' pass and the train step), the median rollout wall time
(`rollout/seconds`: prefill and decode, no compile), the share of the iteration the rollout takes, and the
completion tokens sampled per second (`rollout/tokens_per_sec`). A rollout
decodes every row until the longest completion of its batch ends (`rollout/decode_steps`), so its share grows
with `--new-tokens` and with how unevenly completions end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path

from maxshard import train

REWARD = '''
def digits(prompt, completion, record):
    return sum(c.isdigit() for c in completion[:4]) / 4
'''


def run(root: Path, model: str, steps: int, new_tokens: int, overrides: Sequence[str]) -> dict[str, float]:
    (root / "reward.py").write_text(REWARD)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i:03d} abc="}) + "\n" for i in range(256)))
    argv = [str(Path(common.REPO) / "configs" / "base.yml"), f"model_name={model}", "dataset_type=prompts",
            f"dataset_path={prompts}", "objective=grpo", f"reward={root / 'reward.py'}:digits", "grpo_group_size=8",
            f"grpo_max_new_tokens={new_tokens}", "grpo_max_prompt_length=16",
            f"max_target_length={16 + new_tokens}", "override_model_config=true", "per_device_batch_size=2",
            f"steps={steps}", "log_period=1", "eval_fraction=0", "enable_checkpointing=false",
            "enable_tensorboard=false", f"base_output_directory={root}", f"run_name={model}", *overrides]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (root / model / "metrics.jsonl").read_text().splitlines()]
    # the last step's time is its device time alone (fetched at the loop's end, no rollout after it)
    timed = [r for r in records if "step_time" in r and "rollout/seconds" in r][:-1]
    step = statistics.median(r["step_time"] for r in timed)
    rollout = statistics.median(r["rollout/seconds"] for r in timed)
    return {"step": step, "rollout": rollout, "share": rollout / step,
            "tokens_per_sec": statistics.median(r["rollout/tokens_per_sec"] for r in timed),
            "decode_steps": statistics.median(r["rollout/decode_steps"] for r in timed)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every model")
    parser.add_argument("--models", default="tiny,125m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            rows[model] = run(Path(tmp), model, args.steps, args.new_tokens, args.overrides)
    print("\n| model | step (s) | rollout (s) | rollout share | completion tok/s | decode steps |")
    print("|---|---|---|---|---|---|")
    for model, r in rows.items():
        print(f"| {model} | {r['step']:.3f} | {r['rollout']:.3f} | {r['share']:.0%} | {r['tokens_per_sec']:,.0f} "
              f"| {r['decode_steps']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
