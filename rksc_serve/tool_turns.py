"""The engine work behind a chat choice with tools offered or a JSON answer asked for.

Every decision is ``rksc_engine.structured.tools``' (the LangChain and LlamaIndex adapters make the same calls),
so a client gets the same calls and JSON over HTTP as in-process:
    * A forced call or a JSON answer (``ChatPlan.constrained_from_start``) is decoded under its schema
      from the first token: ``constrained_turn`` -> ``tools.decode_constrained``.
    * Otherwise the model writes free text with the tool-call opener as a stop string; when it starts
      a call, ``finish_turn`` -> ``tools.finish_tool_turn`` finishes it under the tool's schema.

Both make one short blocking engine call per JSON value, so the app runs them on its turn pool
(``rksc_serve.workers``) with a ``CancellableEngine`` as ``engine``: when the client goes away, the
call in flight is cancelled and the next one is refused. The scheduler batches those calls with every
other request. Choice ``i`` of a seeded request decodes with seed ``seed + i``, as sibling branches do.
"""

from __future__ import annotations

from collections.abc import Sequence

from rksc_engine import Completion, SamplingParams
from rksc_engine.protocol import LocalEngine
from rksc_engine.structured import tools as tool_protocol
from rksc_engine.structured.constrained import value_params
from rksc_engine.structured.tools import ToolRequest
from rksc_serve.protocol import ChatPlan
from rksc_serve.responses import FINISH_REASONS, Turn, stop_reason


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (None stays unseeded)."""
    return None if seed is None else seed + index


def constrained_turn(engine: LocalEngine, prompt_ids: Sequence[int], params: SamplingParams, plan: ChatPlan,
                     seed: int | None) -> Turn:
    """A forced call or a JSON answer, decoded under its schema from the first token.

    Args:
        params: The request's sampling settings; each value call keeps their temperature, top_p
            and top_k (``constrained.value_params``).
        seed: This choice's seed.
    """
    tools = plan.tools if plan.tools is not None and plan.tools.forced else None
    result, content = tool_protocol.decode_constrained(
        engine, prompt_ids, value_params(params, seed), tools, plan.schema)
    first = result.completion
    return Turn(content, result.tool_calls, "tool_calls" if result.tool_calls else "stop", None,
                first.num_prompt_tokens, first.num_cached_tokens, result.num_generated_tokens)


def finish_turn(engine: LocalEngine, prompt_ids: Sequence[int], tools: ToolRequest, completion: Completion,
                params: SamplingParams) -> Turn:
    """The turn of a free generation made with ``tools`` offered and the opener among its stops.

    Args:
        params: The request's own sampling settings (its stop strings, without the opener).
    """
    seed = choice_seed(completion.seed, completion.branch_index)
    turn = tool_protocol.finish_tool_turn(engine, prompt_ids, tools, completion,
                                          value_params(params, seed))
    if turn.constrained is not None:
        generated = turn.constrained.num_generated_tokens
    else:
        generated = completion.num_generated_tokens
    if turn.tool_calls:
        return Turn(turn.text, turn.tool_calls, "tool_calls", None, completion.num_prompt_tokens,
                    completion.num_cached_tokens, generated)
    return Turn(turn.text, (), FINISH_REASONS[completion.finish_reason],
                stop_reason(completion, params.stop, engine.tokenizer), completion.num_prompt_tokens,
                completion.num_cached_tokens, generated)
