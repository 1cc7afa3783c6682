"""The command line: `threefold <command>` (``main``), `threefold convert`, `threefold plot`,
the post-training commands (``posttrain``) and `threefold plan` (``planning``, its options in ``plan_options``).
"""
