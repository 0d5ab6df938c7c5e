"""Logging a PyTorch model into a given run, on MLflow 2.x and 3.x alike, without the fluent run stack.

The driver's writer thread has no active fluent run (and must not start one: that would end or
shadow the user's). ``Model.log`` takes ``run_id`` in recent MLflow, and ``mlflow.pytorch.log_model``
passes it through; its destination is ``name=`` in MLflow 3 and ``artifact_path=`` in 2.x. Where
``run_id`` is not accepted, or the name is a path MLflow 3 refuses as a logged model's name (with a
``/`` or a ``.``, e.g. ``models/final``), the model is saved locally with ``save_model`` and uploaded
with ``MlflowClient.log_artifacts``, which gives the same ``runs:/<run_id>/<name>`` layout.
"""
from __future__ import annotations

import inspect
import os
import re
import tempfile
import warnings
from typing import Any, Mapping

from spark_dl.errors import TrackingWarning

# what MLflow 3 refuses in a logged model's name (mlflow.utils.validation._validate_logged_model_name);
# a model named so is stored with save_model + log_artifacts, which take any path in the run
_NOT_IN_LOGGED_MODEL_NAME = ("/", ":", ".", "%", '"', "'")


def run_on_example(model: Any, input_example: Any) -> tuple[Any, Any]:
    """``(input_example as a numpy array, model's output on it)``: what the signature is inferred
    from. The rank calls it at ``log_model`` (so an example the model cannot take fails there) and
    the driver again when it logs the model."""
    import numpy as np
    import torch

    example = np.asarray(input_example)
    with torch.no_grad():
        out = model(torch.as_tensor(example))
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().numpy()
    return example, out


def _signature_kwargs(model: Any, input_example: Any, name: str = "model") -> dict[str, Any]:
    """The signature and example to log ``model`` with; none (and a warning) when they cannot be
    inferred, so that the model is still logged."""
    if input_example is None:
        return {}
    try:
        from mlflow.models import infer_signature

        example, out = run_on_example(model, input_example)
        return {"signature": infer_signature(example, out), "input_example": example}
    except Exception as e:  # noqa: BLE001 - the model matters more than its signature

        warnings.warn(f"log_model: no signature could be inferred for model {name!r} from its input_example "
                      f"({type(e).__name__}: {e}); it is logged without a signature and input example",
                      TrackingWarning, stacklevel=2)
        return {}


def without_local_label(requirement: str) -> str:
    """``torch==2.13.0+cpu`` as ``torch==2.13.0``: a local version label names a build that no
    index serves under that name (PyPI has no ``+cpu``), so a pinned requirement keeping it cannot be
    installed. Whether MLflow strips it depends on its and ``packaging``'s versions; this does always."""
    return re.sub(r"(==\s*[^\s;,+]+)\+[^\s;,]*", r"\1", requirement)


def pip_requirements(model: Any) -> list[str]:
    """The pinned pip requirements of a pickled ``model``: MLflow's defaults for the pytorch flavor
    (torch, cloudpickle) and the installed distributions whose packages define its modules'
    classes or their bases (``torchvision``, ``timm``, ``lightning``, ...), which are what loading
    it imports (MLflow adds itself). MLflow would infer them by loading the model in a subprocess,
    about 5 s per logged model."""
    from importlib import metadata

    import mlflow.pytorch

    out = {r.split("==")[0]: without_local_label(r) for r in mlflow.pytorch.get_default_pip_requirements()}
    owners = metadata.packages_distributions()
    # the classes' bases too: a LightningModule subclass defined in a notebook still imports lightning
    classes = {c for m in model.modules() for c in type(m).__mro__}
    for package in sorted({(getattr(c, "__module__", None) or "").split(".")[0] for c in classes} - {""}):
        for dist in owners.get(package, []):
            if dist not in out:
                try:
                    out[dist] = without_local_label(f"{dist}=={metadata.version(dist)}")
                except metadata.PackageNotFoundError:
                    pass
    return sorted(out.values())


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
    kwargs = _signature_kwargs(model, input_example, name)
    kwargs["pip_requirements"] = pip_requirements(model)
    takes = inspect.signature(mlflow.pytorch.log_model).parameters
    if "serialization_format" in takes:
        # MLflow 3's default ('pt2') traces forward() with torch.export: it refuses a model logged
        # without an input example and fails on models torch.export cannot trace; pickle takes any
        # module and loads back as the same class
        kwargs["serialization_format"] = "pickle"
    if "run_id" in inspect.signature(Model.log).parameters and (
        "name" not in takes or not any(c in name for c in _NOT_IN_LOGGED_MODEL_NAME)
    ):
        where = {"name": name} if "name" in takes else {"artifact_path": name}
        mlflow.pytorch.log_model(model, run_id=run_id, **where, **kwargs)
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        mlflow.pytorch.save_model(model, path, **kwargs)
        client.log_artifacts(run_id, path, name)
