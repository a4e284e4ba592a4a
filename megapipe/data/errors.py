"""The data layer's one error type: a bad path, flag value or file, said in one line."""


class DataError(ValueError):
    """Bad data input (a path, a flag value, a file): the message is one line naming the value.

    A ``ValueError``, so ``megapipe``'s command line prints it as one line and exits with status
    2, and the pretrain job's checks can raise it before any process group exists.
    """
