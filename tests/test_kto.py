"""KTO against TRL's own numbers (tests/fixtures/preference `kto`, made by tools/make_preference_fixtures.py with TRL
1.16's KTOTrainer): on the imported qwen3 fixture, maxshard's loss, logged metrics and the gradient w.r.t. every
parameter equal TRL's within 1e-5, with the examples packed into rows as the preference reader packs them (two
examples in a row, rows left empty; each example's KL sequence beside it); the same under fsdp=4 x tensor=2; the
reader turns TRL's records (JSONL, Hugging Face rows) into TRL's token ids and KL sequences, skips bad records and
packs whole examples; KTO's config errors are one line. Its CLI run is test_preference_cli.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import max_relative_difference
from test_objectives import CASES, LAYOUTS, LENGTH, TOLERANCE, import_fixtures, start

from maxshard import config, data
from maxshard.data import make_input, packing, preference
from maxshard.data.chat import WEIGHT
from maxshard.data.sources import BadRecord, ReadOptions
from maxshard.data.tokenizer import load_hf_tokenizer
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib
from maxshard.training.step import mesh_context
from tests.test_data import BASE

KTO = CASES["kto"]
QWEN = Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3" / "tokenizer.json"
ROWS = ((0, 1), (2,), (), (3, 4), (), (), (), ())  # which examples each row of the batch of 8 holds, in order
KEYS = ("objective=kto", f"kto_beta={KTO['config']['beta']}",
        f"kto_desirable_weight={KTO['config']['desirable_weight']}",
        f"kto_undesirable_weight={KTO['config']['undesirable_weight']}")
METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
           "rewards/margins": "rewards/margin", "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected",
           "kl": "kl"}  # TRL's names -> maxshard's


def example_rows() -> dict[str, np.ndarray]:
    """The fixture's examples in rows of LENGTH as `data/preference.py` lays them out: example e of a row is segments
    2e - 1 (prompt + completion, weight +1 or -1 by its label on completion targets) and 2e (prompt + the KL
    completion, weight 1 on its targets), each shifted by one."""
    fields = {k: np.zeros((len(ROWS), LENGTH), np.float32 if k == "loss_weights" else np.int32)
              for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")}
    for r, members in enumerate(ROWS):
        at, segment = 0, 0
        for index in members:
            example = KTO["examples"][index]
            label = 1.0 if example["label"] else -1.0
            for completion, weight in ((example["completion_ids"], label), (example["KL_completion_ids"], 1.0)):
                tokens, segment = np.asarray(example["prompt_ids"] + completion), segment + 1
                n = len(tokens) - 1
                fields["inputs"][r, at:at + n], fields["targets"][r, at:at + n] = tokens[:-1], tokens[1:]
                fields["segment_ids"][r, at:at + n], fields["positions"][r, at:at + n] = segment, np.arange(n)
                fields["loss_weights"][r, at:at + n] = weight * (np.arange(1, n + 1) >= len(example["prompt_ids"]))
                at += n
    return fields


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), ("kto",))


@pytest.fixture(scope="module")
def runs(imported, tmp_path_factory):
    """runs(layout) -> (loss, metrics, gradients) of maxshard's KTO on the fixture batch; cached."""
    cache = {}

    def run(layout: str):
        if layout not in cache:
            tmp = tmp_path_factory.mktemp(f"kto_{layout}")
            knobs, devices = LAYOUTS[layout]
            trainer, state = start(imported, tmp, "policy", *KEYS, *knobs, devices=devices)
            reference = start(imported, tmp, "reference", *knobs, devices=devices)[1].params
            batch = jax.device_put(example_rows(),
                                   trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
            with mesh_context(trainer.mesh, trainer.rules):
                grads, sums = jax.jit(trainer._grads)(state.params, batch, None, reference)
                metrics = jax.jit(trainer.objective.metrics)(sums)
            examples = float(sums["weight_sum"])
            cache[layout] = (float(sums["loss_sum"]) / examples, jax.device_get(metrics),
                             jax.tree.map(lambda g: np.asarray(g) / examples, jax.device_get(grads)))
        return cache[layout]

    return run


def test_loss_metrics_and_gradients_equal_trl(runs, imported, tmp_path):
    loss, metrics, grads = runs("one_device")
    assert loss == pytest.approx(KTO["loss"], abs=TOLERANCE)
    assert KTO["metrics"]["kl"] > 0.1  # the reference point is not clamped away: the KL sequences count
    for trl_name, name in METRICS.items():
        assert float(metrics[name]) == pytest.approx(KTO["metrics"][trl_name], abs=TOLERANCE, rel=TOLERANCE), name
    trl_grads = start(imported, tmp_path, "kto")[1].params
    assert max_relative_difference(grads, trl_grads) < TOLERANCE


def test_fsdp4_tensor2_equals_one_device(runs):
    loss, metrics, grads = runs("fsdp4_tensor2")
    one_loss, one_metrics, one_grads = runs("one_device")
    assert loss == pytest.approx(one_loss, abs=1e-6)
    assert max_relative_difference(grads, one_grads) < 1e-5
    for name, value in one_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(value), abs=1e-5), name


# ------------------------------------------------------------------ the reader: TRL's records -> TRL's ids and KL pairs


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def halves_of(example: dict[str, np.ndarray]) -> list[tuple[list[int], list[float]]]:
    """(tokens, weights of each target) of the example's two halves."""
    out = []
    for half in (1, 2):
        mine = example[packing.HALF] == half
        out.append(([*example["inputs"][mine].tolist(), int(example["targets"][mine][-1])],
                    example[WEIGHT][mine].tolist()))
    return out


def test_the_reader_gives_trl_ids_and_kl_sequences(tmp_path):
    """TRL's records through `dataset_type: preference` give, with the same tokenizer, TRL's token ids: each example's
    first half is prompt_ids + completion_ids, weighted +1 (desirable) or -1 on the completion's ids, its second
    prompt_ids + KL_completion_ids, weighted 1 there: TRL's rotation, for a source that is one batch."""
    path = write_jsonl(tmp_path / "kto.jsonl", KTO["records"])
    corpus = preference.open_source(str(path), "dataset_path", False, ReadOptions("", "text", "messages", "train",
                                                                                   "", "never"))
    encoder = preference.PreferenceEncoder(load_hf_tokenizer(str(QWEN)), None, 4096)
    assert len(corpus.documents) == len(KTO["examples"])
    for index, trl in enumerate(KTO["examples"]):
        (tokens, weights), (kl_tokens, kl_weights) = halves_of(encoder(corpus.documents[index], f"record {index}"))
        prompt = len(trl["prompt_ids"]) - 1  # targets before the completion's first
        assert tokens == trl["prompt_ids"] + trl["completion_ids"]
        assert kl_tokens == trl["prompt_ids"] + trl["KL_completion_ids"]
        sign = 1.0 if trl["label"] else -1.0
        assert weights == [0.0] * prompt + [sign] * len(trl["completion_ids"])
        assert kl_weights == [0.0] * prompt + [1.0] * len(trl["KL_completion_ids"])


def test_bad_records_are_skipped_and_a_kl_completion_comes_from_the_nearest_good_record():
    records = [preference.as_unpaired(r, f"line {i}") for i, r in enumerate([
        {"prompt": "a", "completion": " b", "label": True},
        {"prompt": "c", "completion": " d", "label": "yes"},
        {"prompt": "e", "completion": " f"},
        {"prompt": [{"role": "user", "content": "g"}], "completion": " h", "label": False},
        {"prompt": "i", "completion": " j", "label": False}])]
    assert [r.reason if isinstance(r, BadRecord) else r.label for r in records] == [
        True, "label not a boolean", "missing field", "text mixed with messages", False]
    documents = preference.KlCompletions(records)
    assert documents[4].rejected == " b" and documents[0].rejected == " j"
    assert documents[1] is records[1]
    alone = preference.KlCompletions(records[:1])
    assert alone[0].reason == "no record nearby for its KL completion"


def test_rows_hold_whole_examples_with_their_labels(tmp_path):
    """Through make_input (objective kto, dataset_type preference): a row's segments 2e - 1 and 2e are an example's
    own and KL sequences with the same prompt; the own completion weighs its label, the KL one 1."""
    records = [{"prompt": f"q{i}:", "completion": " yes" if i % 2 else " no no", "label": bool(i % 2)}
               for i in range(12)]
    path = write_jsonl(tmp_path / "kto.jsonl", records)
    cfg = config.load([BASE, "dataset_type=preference", "objective=kto", f"dataset_path={path}",
                       "per_device_batch_size=1", "max_target_length=32", "eval_fraction=0"])
    batch = jax.device_get(next(make_input(cfg, mesh_lib.build(cfg))))
    labels = 0
    for row in range(batch["segment_ids"].shape[0]):
        segments, weights = batch["segment_ids"][row], batch["loss_weights"][row]
        for e in range(1, int(segments.max()) // 2 + 1):
            own, kl = weights[segments == 2 * e - 1], weights[segments == 2 * e]
            sign = set(own[own != 0].tolist())
            assert sign in ({1.0}, {-1.0}) and set(kl[kl != 0].tolist()) == {1.0}
            prompt = int(np.argmax(own != 0))
            assert (batch["inputs"][row][segments == 2 * e - 1][:prompt + 1]
                    == batch["inputs"][row][segments == 2 * e][:prompt + 1]).all()
            labels += sign == {1.0}
    assert labels > 0 and (batch["segment_ids"] > 0).any()


def test_an_encoder_told_its_objective_skips_records_of_the_other_kind():
    encoder = preference.PreferenceEncoder(load_hf_tokenizer(str(QWEN)), None, 4096, unpaired=True)
    pair = preference.as_preference(CASES["records"][0], "pair")
    example = preference.KlCompletions([preference.as_preference(r, "x") for r in KTO["records"]])[1]
    assert encoder(pair, "pair").reason == "a pair, not an unpaired record"
    assert not isinstance(encoder(example, "x"), BadRecord)
    pairs_only = dataclasses.replace(encoder, unpaired=False)
    assert pairs_only(example, "x").reason == "an unpaired record, not a pair"
    assert not isinstance(pairs_only(pair, "pair"), BadRecord)


def test_hugging_face_rows_map_style_and_streamed(tmp_path):
    """A save_to_disk directory of unpaired rows reads as JSONL does (each with the previous row's completion); a
    streamed one is refused in one line (its records have no neighbours to take a KL completion from)."""
    import datasets

    datasets.Dataset.from_list(KTO["records"]).save_to_disk(str(tmp_path / "kto"))
    options = ReadOptions("", "text", "messages", "train", "", "never")
    documents = preference.open_source(str(tmp_path / "kto"), "dataset_path", False, options).documents
    assert [(d.chosen, d.rejected, d.label) for d in documents] == [
        (r["completion"], KTO["records"][i - 1]["completion"], r["label"]) for i, r in enumerate(KTO["records"])]
    (tmp_path / "parquet").mkdir()
    datasets.Dataset.from_list(KTO["records"]).to_parquet(str(tmp_path / "parquet" / "a.parquet"))
    streamed = dataclasses.replace(options, hf_streaming="always")
    with pytest.raises(ConfigError, match=r"^dataset_path=\S+: unpaired records .* set hf_streaming=never$"):
        preference.open_source(f"{tmp_path}/parquet/*.parquet", "dataset_path", False, streamed)


@pytest.mark.parametrize(("key", "message"), [
    ("kto_beta=0", "^kto_beta must be > 0, got 0"),
    ("kto_desirable_weight=0", "^kto_desirable_weight must be > 0, got 0"),
    ("kto_undesirable_weight=-1", "^kto_undesirable_weight must be > 0, got -1"),
    ("dataset_type=jsonl", "^objective=kto trains on preference records: set dataset_type to one of synthetic, "
                           "preference"),
])
def test_config_errors_are_one_line(key, message):
    with pytest.raises(ConfigError, match=message) as error:
        config.load([BASE, "objective=kto", *(() if key.startswith("dataset_type") else ("dataset_type=synthetic",)),
                     key])
    assert "\n" not in str(error.value)
