"""Where a run's metrics go: the loggers `trainer.loggers` names, beside the run directory
(`xray.run.outputs`, whose `RunDir` holds one `MetricLoggers`).

    jsonl         RUN_DIR/metrics.jsonl, one JSON object per logged step (the run report reads it)
    tensorboard   RUN_DIR/tensorboard/, TensorBoard events
    wandb         Weights & Biases: offline under RUN_DIR/wandb unless WANDB_MODE or WANDB_API_KEY
                  is set (`pip install 'wandb>=0.31'`)
    mlflow        MLflow: a local file store RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set
                  (`pip install 'mlflow-skinny>=3.17'`)

`registry` names them and the packages they need (checked before a run starts), `fanout` sends
each step to every configured logger and closes them all, and one module per logger talks to
its library. Each logger records the resolved config as the run's hyper-parameters.
"""
from xray.run.loggers.fanout import MetricLoggers
from xray.run.loggers.registry import DEFAULT_LOGGERS, LOGGERS, LoggerUnavailable, check_loggers

__all__ = ["MetricLoggers", "DEFAULT_LOGGERS", "LOGGERS", "LoggerUnavailable", "check_loggers"]
