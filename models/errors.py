"""Bad-input errors raised below the CLI; the CLI turns them into a one-line message and exit 2."""
from bcdflow.errors import BadInput


class ConfigError(BadInput):
    """A configuration value is invalid. The message names the key and the allowed values."""


class Diverged(BadInput):
    """Training produced a non-finite loss or gradient norm (most often: the learning rate is too high).

    Bad input rather than a fault: retrying the same settings diverges again, so it is never retried."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"training diverged at step {step}: loss {loss:g}, gradient norm {grad_norm:g}")
