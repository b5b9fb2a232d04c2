"""Calling-context trees as a speedscope file (https://www.speedscope.app, which Perfetto's
UI links to as well): one profile per rank for host time, one for GPU time.

Host profiles weigh each call path by its self time (its time less its host-side children),
so the stacks add up to the host's time; GPU profiles weigh each device path (kernel, copy,
memset, with the host path that launched it) by its duration.
"""

from __future__ import annotations

from typing import Any

from trainscope.traces.cct import PathTimes, path_of

DEVICE_LAYERS = frozenset({"cuda_kernel", "memcpy", "gpu_user_annotation"})
SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def speedscope(trees: dict[str, PathTimes], name: str = "trainscope") -> dict[str, Any]:
    """``trees`` maps a profile name (e.g. ``rank 3``) to its tree."""
    frames: list[dict[str, str]] = []
    frame_ids: dict[str, int] = {}

    def frame(label: str) -> int:
        index = frame_ids.get(label)
        if index is None:
            index = frame_ids[label] = len(frames)
            frames.append({"name": label})
        return index

    profiles = []
    for profile, times in trees.items():
        for kind, on_device in (("host", False), ("GPU", True)):
            samples, weights = [], []
            for cp in sorted(times.count):
                path = path_of(times.nodes, cp)
                if not path or (path[-1][0] in DEVICE_LAYERS) != on_device:
                    continue
                # A device event's own time is its duration; a GPU annotation encloses kernels.
                if on_device and path[-1][0] == "gpu_user_annotation":
                    continue
                weight = times.total_ns[cp] if on_device else times.self_ns[cp]
                if weight <= 0:
                    continue
                samples.append([frame(label) for _, label in path])
                weights.append(int(weight))
            if samples:
                profiles.append({"type": "sampled", "name": f"{profile} {kind}",
                                 "unit": "nanoseconds", "startValue": 0,
                                 "endValue": sum(weights), "samples": samples,
                                 "weights": weights})
    return {"$schema": SCHEMA, "name": name, "exporter": "trainscope",
            "shared": {"frames": frames}, "profiles": profiles, "activeProfileIndex": 0}
