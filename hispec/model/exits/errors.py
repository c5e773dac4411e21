"""The one error of exit-head handling."""


class ExitHeadError(ValueError):
    """Exit heads cannot be used with this model, or their files are broken; the message says why."""
