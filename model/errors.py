"""The errors a user causes by pointing llamaserve at a model: each carries one sentence
naming the file or field and the problem, which the CLI prints before exiting 2.

Defined apart from the code that raises them so that every reader (config, weights,
tokenizer) and the CLI import one module, and none imports another only for its error.

Nothing here decides what happens next: readers raise, the CLI prints and exits.
"""


class ModelFileError(ValueError):
    """A model file that cannot be used; the message is one sentence naming file and problem."""


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes a network llamaserve does not run."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be built faithfully; the message says which field and why."""


class UnsupportedFormatError(ValueError):
    """A weight format (dtype, quantisation) this device or this flag combination cannot run."""
