"""Logging a PyTorch model into a given run, on MLflow 2.x and 3.x alike, without the fluent run stack.

The driver's writer thread has no active fluent run (and must not start one: that would end or
shadow the user's). ``Model.log`` takes ``run_id`` in recent MLflow, and ``mlflow.pytorch.log_model``
passes it through; its destination is ``name=`` in MLflow 3 and ``artifact_path=`` in 2.x. Where
``run_id`` is not accepted, the model is saved locally with ``save_model`` and uploaded with
``MlflowClient.log_artifacts``, which gives the same ``runs:/<run_id>/<name>`` layout.
"""
from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any, Mapping


def _signature_kwargs(model: Any, input_example: Any) -> dict[str, Any]:
    if input_example is None:
        return {}
    import numpy as np
    import torch
    from mlflow.models import infer_signature

    example = np.asarray(input_example)
    with torch.no_grad():
        out = model(torch.as_tensor(example))
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().numpy()
    return {"signature": infer_signature(example, out), "input_example": example}


def log_torch_model(model: Any, name: str, input_example: Any, run_id: str, client: Any = None) -> None:
    """Log ``model`` (an ``nn.Module``, or a ``state_dict``) as ``runs:/<run_id>/<name>``."""
    import mlflow
    import mlflow.pytorch
    from mlflow.models import Model

    client = client or mlflow.MlflowClient()
    if isinstance(model, Mapping):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, name)
            mlflow.pytorch.save_state_dict(model, path)
            client.log_artifacts(run_id, path, name)
        return
    model.eval()
    kwargs = _signature_kwargs(model, input_example)
    takes = inspect.signature(mlflow.pytorch.log_model).parameters
    if "serialization_format" in takes:
        # MLflow 3's default ('pt2') traces forward() with torch.export: it refuses a model logged
        # without an input example and fails on models torch.export cannot trace; pickle takes any
        # module and loads back as the same class
        kwargs["serialization_format"] = "pickle"
    if "run_id" in inspect.signature(Model.log).parameters:
        where = {"name": name} if "name" in takes else {"artifact_path": name}
        mlflow.pytorch.log_model(model, run_id=run_id, **where, **kwargs)
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        mlflow.pytorch.save_model(model, path, **kwargs)
        client.log_artifacts(run_id, path, name)
