#!/usr/bin/env bash
# Runs the tracking tests against MLflow 2.x (the default install has 3.x): a venv on top of the
# current environment, with mlflow 2.22 and the SQLAlchemy/alembic versions it supports.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-/tmp/spark-dl-mlflow2}"
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "mlflow==2.22.*" "sqlalchemy<2.1" "alembic<1.16"
"$venv/bin/python" -c "import mlflow; print('mlflow', mlflow.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/tracking "$@"
