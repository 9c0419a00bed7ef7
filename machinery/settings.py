"""Settings of a script (train.py's): --help, config files of `key = value` lines, --key=value
flags.

A script's settings are a table, name -> (default, help text) or (default, help text, rule),
passed in: the default's type is the setting's type, choices (name -> the values allowed) narrows
some of them, and a rule (at_least, above, below, ...) bounds a number. A config file is parsed,
never executed. Every problem is a SettingsError of one line that names where it is and what to do.
"""

import ast
import difflib


class SettingsError(ValueError):
    pass


def at_least(low):
    """A rule: the value is >= low (said "at least 1" for 1, ">= low" otherwise)."""
    said = f"at least {low}" if low == 1 else f">= {low}"
    return lambda value: None if value >= low else f"must be {said}"


def above(low):
    """A rule: the value is > low."""
    return lambda value: None if value > low else f"must be > {low}"


def below(high, said):
    """A rule: the value is < high (said: how high is said, e.g. 2^31)."""
    return lambda value: None if value < high else f"must be below {said}"


def within(low, high, said=None):
    """A rule: low <= value < high (said: how high is said, e.g. 2^31)."""
    return lambda value: None if low <= value < high else f"must be in [{low}, {said or high})"


def all_of(*rules):
    """A rule: every one of rules, the first complaint said."""
    return lambda value: next((c for c in (rule(value) for rule in rules) if c), None)


def check_rules(settings, table):
    """Each setting against its table entry's rule, if it has one: a SettingsError for the first
    that breaks it."""
    for key, (_, _, *rule) in table.items():
        complaint = rule[0](settings[key]) if rule else None
        if complaint:
            raise SettingsError(f"{key}={settings[key]} {complaint}")


def help_text(doc, table):
    """The script's docstring, then every setting with its default and help."""
    lines = [doc.strip(), "", "settings (--key=value, default shown):"]
    for key, (default, text, *_) in table.items():
        lines.append(f"  --{key}={default}".ljust(38) + f" {text}")
    return "\n".join(lines)


def check_known(key, where, table, program):
    if key not in table:
        close = difflib.get_close_matches(key, table, n=1)
        hint = f"did you mean {close[0]}?" if close else f"see python {program} --help"
        raise SettingsError(f"{where}: unknown setting {key!r}; {hint}")


def set_setting(settings, key, value, where, table, choices):
    """Check a setting's type (and choice), then store it (ints are accepted where floats are
    expected). key must be in the table (check_known)."""
    default = table[key][0]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(default):
        kinds = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
        kind = kinds[type(default)]
        raise SettingsError(f"{where}: {key}={value!r} must be {kind} (default: {default!r})")
    if key in choices and value not in choices[key]:
        raise SettingsError(f"{where}: {key}={value!r}; choose one of {', '.join(choices[key])}")
    settings[key] = value


def read_config_file(path):
    """A config file's (key, value, where) triples. Only `key = literal` lines (and comments) are
    allowed: the file is parsed, never executed."""
    for node in parse_config_file(path).body:
        where = f"{path} line {node.lineno}"
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise SettingsError(f"{where}: only `key = value` lines are allowed in a config file")
        key = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except (ValueError, TypeError, RecursionError, MemoryError):  # TypeError: {[]: 1}
            raise SettingsError(f"{where}: the value of {key} must be a literal (number, string, "
                                f"True or False)") from None
        if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
            raise SettingsError(f"{where}: the value of {key} holds a surrogate escape (\\ud800 "
                                f"to \\udfff), which is no character; write the character itself")
        yield key, value, where


def parse_config_file(path):
    """A config file's syntax tree; every failure is a SettingsError naming the file and line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror}") from None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SettingsError(f"config file {path} is not UTF-8 text (byte {e.start}) on line "
                            f"{line}; save it as UTF-8") from None
    if "\0" in source:
        line = source.count("\n", 0, source.index("\0")) + 1
        raise SettingsError(f"config file {path}, line {line}: a NUL byte; only `key = value` "
                            f"lines are allowed") from None
    try:
        return ast.parse(source, path)
    except (MemoryError, RecursionError):
        raise SettingsError(f"config file {path} is nested too deeply to read; only `key = value` "
                            f"lines are allowed") from None
    except (SyntaxError, ValueError) as e:
        what = str(getattr(e, "msg", e)).split(";")[0]  # not Python's advice to programmers
        raise SettingsError(f"config file {path}, line {getattr(e, 'lineno', '?')}: {what}; only "
                            f"`key = value` lines are allowed") from None


def parse_args(argv, table, choices, program):
    """argv (config files and --key=value flags, in order) -> (settings, the names set explicitly by
    config files or flags). program: the script's file name, for the hint to its --help."""
    settings = {key: entry[0] for key, entry in table.items()}
    explicit = set()
    for arg in argv:
        if not arg.startswith("--"):
            for key, value, where in read_config_file(arg):
                check_known(key, where, table, program)
                set_setting(settings, key, value, where, table, choices)
                explicit.add(key)
            continue
        key, has_value, text = arg[2:].partition("=")
        if not has_value:  # a bare --compile means --compile=True
            if not isinstance(table.get(key, ("",))[0], bool):
                raise SettingsError(f"{arg}: expected --key=value (see python {program} --help)")
            text = "True"
        if isinstance(table.get(key, (None,))[0], str):
            value = text  # strings need no quotes on the command line
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                value = text  # TypeError: {[]: 1}
        check_known(key, arg, table, program)
        set_setting(settings, key, value, arg, table, choices)
        explicit.add(key)
    return settings, explicit
