"""A multi-turn GRPO environment: an arithmetic drill with a calculator tool.

    python -m maxshard.train configs/base.yml objective=grpo dataset_type=prompts dataset_path=sums.jsonl \
        grpo_environment=examples/arithmetic_env.py:drill grpo_max_turns=3

Each prompt record holds a question in `prompt` ("7+5=") and its answer in `answer` ("12"). The model has two
attempts: after a wrong one the environment says so and asks again. It may call the calculator in a turn, as
`<tool_call>{"name": "calculate", "arguments": {"expression": "7+5"}}</tool_call>`, and reads its result in the next
turn (a tool turn is a model turn, so grpo_max_turns=3 leaves room for one call and two attempts).

Each attempt earns 1 for the right number; a wrong one earns half the share of its first four characters that are
digits, a shaped reward that a model trained from scratch can climb before it can add. The episode's reward is the
sum. Every reply is kept in `replies`, the episode's transcript.
"""

from __future__ import annotations

import ast
import operator
import re

ATTEMPTS = 2
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an expression of integers with +, - and * (parsed, never evaluated as Python)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an expression of integers with + - *: {expression!r}")

    return str(value(ast.parse(expression, mode="eval").body))


class Drill:
    """One episode of the drill (module docstring)."""

    def __init__(self, record: dict) -> None:
        self.question, self.answer = str(record["prompt"]), str(record["answer"]).strip()
        self.tools = [calculate]
        self.replies: list[str] = []

    def step(self, reply: str) -> tuple[str | None, float, bool]:
        self.replies.append(reply)
        number = re.search(r"-?\d+", reply)
        if number is not None and number.group() == self.answer:
            return None, 1.0, True
        credit = 0.5 * sum(c.isdigit() for c in reply[:4]) / 4
        if len(self.replies) >= ATTEMPTS:
            return None, credit, True
        return f"no. {self.question}", credit, False


def drill(record: dict) -> Drill:
    """grpo_environment's function: the episode of one prompt record."""
    return Drill(record)
