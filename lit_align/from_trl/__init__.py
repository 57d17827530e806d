"""``lit-align from-trl COMMAND --config FILE [--field value ...] [-o OUT]``: a TRL run, as TRL's command line
starts it (``trl COMMAND --config FILE ...``), as a lit_align config for ``lit-align fit -c OUT``.

``command_line`` reads TRL's syntax (``--no_flag``, lists, values typed by TRL's fields), ``translate`` sorts the
fields into the recipe's module, data and trainer (``sections``, ``dataset_fields``, ``reward_names``: the fields
whose values change form), and ``trl_fields`` is TRL's table of fields, read from TRL's parsers once (TRL is not
needed at run time).
"""

from lit_align.from_trl.command_line import main
from lit_align.from_trl.translate import COMMANDS, translate

__all__ = ["COMMANDS", "main", "translate"]
