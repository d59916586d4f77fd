"""lm-eval-harness's `LM` backed by maxshard's model on the run's mesh.

Requests become token rows exactly as lm-eval's Hugging Face backend makes them (`lm_eval/models/huggingface.py`),
so a score here is the score that backend gives the same model and tokenizer:

- Encoding (`tok_encode`): the tokenizer's own template (`encode_prompt`: BOS where the tokenizer.json adds one,
  byte-level and SentencePiece always), except for a text that already starts with the prefix token's text. The
  harness's `_encode_pair` splits context and continuation where the context alone ends (trailing spaces go to the
  continuation); an empty context becomes the prefix token: the tokenizer's BOS (`bos_id`, the token its config
  names, whether or not its template adds it; transformers' `bos_token_id`), else EOS. A token the vocabulary holds
  but the config does not name (`<s>` beside a Qwen config's null bos_token) is no BOS, here as there.
- Log-likelihood: the model reads (context + continuation)[-(max_length + 1):][:-1]; the continuation's tokens are
  scored at its last positions (`scoring.py`: sorted by length, batched, padded rows never counted).
- Rolling log-likelihood: lm-eval's own disjoint windows of `max_length` tokens after the prefix token, summed.
- Generation: each context left-truncated to max_length - max_gen_toks, continued by the KV-cached engine
  (`generation/decode.py`) up to max_gen_toks tokens or an EOS id, decoded without special tokens and cut at the
  first stop sequence (the task's `until` and the EOS text), greedy unless the task samples.

`max_length` is the model's `max_target_length` (the context it was trained on). With several processes
(multi-host) every one runs every request, and checks that the others were given the same (`processes.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from jax.sharding import Mesh

from maxshard.config import Config
from maxshard.data.tokenizer import Tokenizer
from maxshard.evaluation import processes
from maxshard.evaluation.scoring import Row, Scorer, bucket_length
from maxshard.generation.decode import Engine
from maxshard.generation.sampling import Sampling, allowed_tokens
from maxshard.parallel import sharding

__all__ = ["MaxshardLM", "build"]


class MaxshardLM(TemplateLM):
    """The harness's model: `scorer` for the log-likelihood requests, `engine` for `generate_until`, `tokenizer`
    for both; `seed` seeds sampled generation (one stream per call)."""

    def __init__(self, scorer: Scorer, engine: Engine, tokenizer: Tokenizer, max_length: int, seed: int = 0) -> None:
        super().__init__()
        self.scorer, self.engine, self.tok, self._max_length, self.seed = scorer, engine, tokenizer, max_length, seed
        self._calls = 0

    # ------------------------------------------------------------------ tokens, as the Hugging Face backend has them

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: the BOS token, else EOS."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256  # the Hugging Face backend's default, for tasks that name none

    def _token_text(self, token: int | None) -> str:
        """A special token's own text ("" where the tokenizer has none: byte-level and SentencePiece)."""
        text = getattr(self.tok, "token_text", None)
        return text(token) if text is not None and token is not None else ""

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            prefix = self._token_text(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return list(self.tok.encode_prompt(string) if add_special_tokens else self.tok.encode(string))

    def _encode_prompt(self, string: str) -> list[int]:
        """A generation context as the backend's batch encoding has it: no template after a leading BOS text."""
        bos = self._token_text(self.tok.bos_id)
        return self.tok_encode(string, add_special_tokens=not (bos and string.startswith(bos)))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    # ------------------------------------------------------------------ log-likelihoods

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append(Row(tuple(whole[:-1]), tuple(continuation)))
        processes.check_same("log-likelihood requests", ([r.inputs for r in rows], [r.targets for r in rows]))
        answers = self.scorer.score(rows, self.tok.pad_id)
        processes.check_same("log-likelihoods", other=answers)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(string)
            for window in lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                context, continuation = lm_utils.make_disjoint_window(window)
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings (one compiled engine serves all of them), each group's
        contexts longest first in calls of `scorer.rows` prompts. With several processes, each checks that the
        others were given the same prompts and ends with the same texts (processes.py)."""
        settings = [json.dumps(request.args[1], sort_keys=True, default=str) for request in requests]
        encoded = [self._encode_prompt(request.args[0]) for request in requests]
        processes.check_same("generation requests", (encoded,), [settings, self.seed, self._calls])  # keys shared
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(settings):
            groups.setdefault(key, []).append(i)
        outputs: list[str] = [""] * len(requests)
        eos_text = self._token_text(self.eot_token_id) or None
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            sampling = _sampling(kwargs)
            keep = self.max_length - max_gen_toks
            if keep <= 0:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a context in the model's "
                                 f"max_target_length={self.max_length}")
            prompts = {i: encoded[i][-keep:] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.scorer.rows):
                chosen = order[start : start + self.scorer.rows]
                batch = [prompts[i] or [self.prefix_token_id] for i in chosen]
                result = self.engine.generate(batch, max_gen_toks, self.tok.stop_ids, self.tok.pad_id, sampling,
                                              self.seed + self._calls, prompt_length=bucket_length(len(batch[0])))
                self._calls += 1
                for i, ids in zip(chosen, result.tokens):
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        processes.check_same("generations", other=outputs)
        return outputs


def _sampling(kwargs: dict[str, Any]) -> Sampling:
    """A task's sampling settings (after `normalize_gen_kwargs`: temperature 0 unless it samples)."""
    if not kwargs.get("do_sample"):
        return Sampling()
    return Sampling(float(kwargs.get("temperature") or 1.0), int(kwargs.get("top_k") or 0),
                    float(kwargs.get("top_p") or 1.0))


def build(cfg: Config, mesh: Mesh, rules: sharding.FlaxRules, params: Any, tokenizer: Tokenizer) -> MaxshardLM:
    """The harness's model for `params` of the run's model on `mesh`: the scorer and the generation engine share
    the parameters (nothing is copied); `eval_batch_size` rows per call, `max_target_length` tokens of context."""
    scorer = Scorer(cfg.model, mesh, rules, params, cfg.eval_batch_size)
    allowed = allowed_tokens(cfg.model.vocab_size, tokenizer.vocab_size, tokenizer.never_generated)
    engine = Engine(cfg.model, mesh, rules, params, allowed)
    return MaxshardLM(scorer, engine, tokenizer, cfg.model.max_target_length, cfg.seed)
