"""A Lightning logger that keeps what it is given, for tests of callbacks in real fits."""

from lightning.pytorch.loggers import Logger


class CaptureLogger(Logger):
    """rows: every (step, name, value) logged; params: the hyperparameters; metrics: the last value of each name."""

    def __init__(self):
        super().__init__()
        self.rows, self.params = [], {}

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    @property
    def metrics(self):
        return {name: value for _, name, value in self.rows}

    def log_hyperparams(self, params, *args, **kwargs):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.rows.extend((step, k, v) for k, v in metrics.items())
