"""The timer of the session-33 experiments in this folder: µs per call of ``fn``, as a CUDA graph of ``reps``
calls (after three warm-up calls on a side stream) replayed ``runs`` times; the median replay over ``reps``."""

import torch


def graph_us(fn, reps: int = 20, runs: int = 5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]
