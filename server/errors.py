"""A mistake a user can fix (a missing folder, no GPU, a file that would be overwritten): the CLI prints its one
line, no traceback, and exits with its code."""


class UserError(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
