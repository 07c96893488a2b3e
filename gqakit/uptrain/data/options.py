"""`gqakit tokenize`'s options, without torch (`token_build` imports it): the command line reads them for
`gqakit --help`."""
from __future__ import annotations

import dataclasses

from gqakit.common.options import option


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
    """`gqakit tokenize`'s options (keywords of `gqakit.uptrain.data.token_build.tokenize_to`)."""

    data: tuple[str, ...] = option(flag="data", help=".txt/.jsonl/.json/.parquet files, folders of row files (.jsonl/"
                                                     ".json/.parquet), datasets save_to_disk folders, or hf:NAME (a "
                                                     "hub dataset, streamed)")
    output: str = option(flag="-o/--output", help="the token cache folder to write")
    tokenizer: str = option(metavar="MODEL", help="model folder whose tokenizer to use")
    num_proc: int = option(1, metavar="N", help="tokenising processes")
    text_column: str = option("text", metavar="NAME", help="column of row files")
    force: bool = option(False, help="replace an existing token cache at -o")
    progress: bool = option(True, flag="-q/--quiet", invert=True, help="no progress bar")
