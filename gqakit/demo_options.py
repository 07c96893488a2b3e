"""`gqakit demo`'s options, beside the demo but without torch: the command line reads them for `gqakit --help`."""
from __future__ import annotations

import dataclasses

from gqakit.common.options import option


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """`gqakit demo`'s options (keywords of `gqakit.demo.run_demo`)."""

    output_dir: str | None = option(None, flag="-o/--output-dir/--output",
                                    help="write the report (and, with --keep, the converted models) here")
    eval_tokens: int = option(16384, help="held-out tokens to score; 0 = all 57,584")
    keep: bool = option(False, help="keep the converted models (with -o)")
    force: bool = option(False, help="replace an existing -o folder")
