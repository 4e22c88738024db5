"""The server's resume checkpoint: one file that holds everything a resumed run needs.

``fedlabels_server_state.pt`` in the server's run folder is written atomically
after each round: the global model, the best model so far, the server rule's
and the round engine's state, the next round, the method and the run token
(the name under which the sites keep their own state, ``site.state_folder``).
Resuming reads this file only, never ``FL_global_model.pt`` or
``progress.json``, so a server killed between writing any two files resumes
from one consistent round. The controller writes this file first, then
``progress.json`` (what a person or a script reads), the round's line of
``metrics.jsonl``, the best model and the persistor's ``FL_global_model.pt``,
so none of them is ever ahead of the checkpoint.

A model file (a global model, a MONAI checkpoint, a state dict of tensors or NumPy arrays) is read by
``load_state_dict``, with ``torch_load``'s allow list: tensors and NumPy arrays only.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from .profile import write_atomic

STATE = "fedlabels_server_state.pt"
FORMAT = 2


def write_checkpoint(folder, *, next_round: int, method: str, run: str, weights: dict, engine: dict,
                     best_weights: dict | None) -> Path:
    path = Path(folder) / STATE
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "next_round": int(next_round), "method": method, "run": run,
                "weights": {k: np.asarray(v) for k, v in weights.items()},
                "best_weights": None if best_weights is None else {k: np.asarray(v) for k, v in best_weights.items()},
                "engine": engine}, buf)
    write_atomic(path, buf.getvalue())
    return path


def read_checkpoint(folder, method: str, rounds: int) -> dict:
    """The checkpoint of the run in ``folder`` (a server run folder), checked against the job that resumes
    it: the same method, a round still to train. Raises ValueError naming the file and field."""
    path = Path(folder) / STATE
    if not path.is_file():
        raise ValueError(f"{path}: no resume checkpoint: {folder} is not the server folder of a run that "
                         "finished a round (WS/server/<job>)")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path}: field 'format': {saved.get('format') if isinstance(saved, dict) else None!r}, "
                         f"not {FORMAT}: a checkpoint of another fedlabels version; rerun the job")
    if saved["method"] != method:
        raise ValueError(f"{path}: field 'method': the run trained {saved['method']!r}, this job runs {method!r}: "
                         "a run resumes only with its own method")
    if saved["next_round"] > rounds:
        raise ValueError(f"{path}: field 'next_round': {saved['next_round']} rounds are done, more than this "
                         f"job's {rounds}")
    return saved


def torch_load(path) -> object:
    """``torch.load(weights_only=True)`` that also accepts NumPy arrays (FLARE saves those).

    Only NumPy's array/dtype reconstruction globals are allow-listed; any
    other pickled object still fails.
    """
    import importlib

    path = str(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # noqa: BLE001
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001
            raise ValueError(f"{path}: not a PyTorch checkpoint ({first})") from None
        allowed = []
        for name in names:
            module, _, attr = name.rpartition(".")
            if not (module == "numpy" or module.startswith("numpy.")):
                raise ValueError(f"{path}: holds a pickled {name}; only tensors and NumPy arrays are accepted") from None
            allowed.append(getattr(importlib.import_module(module), attr))
        allowed += [np.ndarray, np.dtype] + [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)


def load_state_dict(ckpt) -> dict:
    """A network state dict from a checkpoint file or object.

    Accepts MONAI/ignite training checkpoints (``{"model": state_dict, ...}``),
    plain state dicts (FLARE's global model), with tensors or NumPy arrays.
    """
    obj = ckpt
    if isinstance(ckpt, (str, os.PathLike)):
        path = Path(ckpt)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: checkpoint not found")
        obj = torch_load(path)
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{ckpt}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    state = {}
    for k, v in obj.items():
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{ckpt}: entry {k!r} is a {type(v).__name__}, not a tensor or array")
        state[str(k)] = v.detach().cpu()
    return state
