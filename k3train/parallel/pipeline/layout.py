"""Which layers each pipeline stage runs.

The L layers are cut into C = P·V contiguous chunks (virtual stages) in pipeline order; chunk c
runs on stage c mod P, so stage p holds chunks p, p+P, …, p+(V−1)P (the interleaved layout; V = 1
is plain 1F1B). Chunk 0 also embeds the tokens and chunk C−1 also runs the output AttnRes, final
norm, LM head and loss. ``parallel.pipeline_layout`` gives the layers per chunk; a 0 in the first or
last entry puts the embedding or the head on a chunk of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    index: int  # c in 0..C-1, pipeline order
    stage: int  # the pipeline rank that runs it: c mod P
    layers: range
    first: bool  # embeds the tokens
    last: bool  # output AttnRes + norm + LM head + loss


def even_layout(num_layers: int, chunks: int) -> list[int]:
    """Layers per chunk as even as possible, the extra layers on the earlier chunks."""
    base, extra = divmod(num_layers, chunks)
    return [base + (c < extra) for c in range(chunks)]


def layout_error(num_layers: int, pipeline: int, virtual: int, layout: list[int]) -> str | None:
    """Why (pipeline, virtual_stages, pipeline_layout) cannot split ``num_layers``, naming the field
    and the fix; None when it can."""
    C = pipeline * virtual
    if virtual > 1 and pipeline == 1:
        return f"parallel.virtual_stages={virtual} needs parallel.pipeline > 1; set parallel.virtual_stages=1"
    if not layout:
        if num_layers < C:
            return (f"parallel.virtual_stages={virtual} leaves fewer than one layer per chunk (model.num_layers="
                    f"{num_layers} over parallel.pipeline*virtual_stages={C} chunks); lower parallel.virtual_stages "
                    f"to at most {max(1, num_layers // pipeline)}")
        if num_layers % C:
            return (f"model.num_layers={num_layers} does not split into parallel.pipeline*virtual_stages={C} equal "
                    f"chunks; set parallel.pipeline_layout={even_layout(num_layers, C)} (layers per chunk, uneven "
                    f"is fine) or change parallel.pipeline / parallel.virtual_stages")
        return None
    if len(layout) != C:
        return (f"parallel.pipeline_layout={list(layout)} has {len(layout)} entries; give parallel.pipeline*"
                f"virtual_stages={C} (layers per chunk in pipeline order), e.g. {even_layout(num_layers, C)}")
    if any(n < 0 for n in layout) or sum(layout) != num_layers:
        return (f"parallel.pipeline_layout={list(layout)} covers {sum(layout)} layers, model.num_layers={num_layers}: "
                f"make the entries non-negative and sum to {num_layers}, e.g. {even_layout(num_layers, C)}")
    empty = [c for c in range(1, C - 1) if layout[c] == 0]
    if empty or (C == 1 and layout[0] == 0):
        return (f"parallel.pipeline_layout={list(layout)} has an empty chunk at {empty}: only the first (embedding "
                f"alone) or the last (head alone) chunk may hold 0 layers; move a layer there")
    return None


def build_chunks(num_layers: int, pipeline: int, virtual: int, layout: list[int] | None = None) -> list[Chunk]:
    """All C chunks of the pipeline (every rank knows the whole layout)."""
    error = layout_error(num_layers, pipeline, virtual, list(layout or []))
    if error:
        raise ValueError(error)
    C = pipeline * virtual
    counts = list(layout) if layout else even_layout(num_layers, C)
    chunks, start = [], 0
    for c, n in enumerate(counts):
        chunks.append(Chunk(c, c % pipeline, range(start, start + n), c == 0, c == C - 1))
        start += n
    return chunks
