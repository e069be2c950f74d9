"""The one error type a user sees: a single line naming the file or field and what to do."""


class UserError(Exception):
    """A problem with the user's input (target, kernel source, package, plugin).

    Printed as one line, without a traceback, and the build exits non-zero. ``where`` names the
    file, field, plugin or kernel the problem is in.
    """

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


class PackageError(UserError):
    """A package (.ipuexe) that is corrupt, hostile or of an unknown version."""
