"""A tool-using agent with a calculator tool, for `tokentape rollout calculator`.

The model may call `calculator(expression)`; the agent evaluates the expression (arithmetic only) and
sends the result back as a tool message, for up to three rounds. Reward: 1 if the final answer
contains the right number, 0.5 if the model at least made a well-formed tool call, else 0.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from typing import Any

import openai

from tokentape.rollout import Episode

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as '12 * (3 + 4)'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> float:
    """Arithmetic only: numbers, + - * / and parentheses."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("only arithmetic is allowed")

    return walk(ast.parse(expression, mode="eval").body)


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    rng = random.Random(episode.group)
    x, y = rng.randint(11, 99), rng.randint(11, 99)
    messages: list[Any] = [
        {"role": "system", "content": "Use the calculator tool for arithmetic."},
        {"role": "user", "content": f"What is {x} * {y}? Use the calculator."},
        # one worked exchange: a 135M model calls tools far more often with an example in front of it
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_example",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": "2 * 3"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_example", "content": "6"},
        {"role": "assistant", "content": "That example gives 6. Now your numbers."},
        {"role": "user", "content": f"Go ahead: {x} * {y}."},
    ]
    called = False
    for _ in range(3):
        reply = await client.chat.completions.create(
            model=episode.model,
            messages=messages,
            tools=TOOLS,
            max_tokens=64,
            temperature=0.7,
            seed=episode.index,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            return 1.0 if str(x * y) in (message.content or "") else (0.5 if called else 0.0)
        for call in message.tool_calls:
            called = True
            try:
                result = str(calculate(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, SyntaxError, ZeroDivisionError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.5 if called else 0.0
