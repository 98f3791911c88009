"""The batch scripts' templates: the two marked blocks ``ckpteval submit`` fills in.

Every script in ``sbatch/`` holds one options block (``#SBATCH`` lines, one group per heterogeneous-job
component) and one settings block (``export CKPTEVAL_*=...`` lines); :func:`render` replaces both and
leaves the rest of the template as written. Promise: a template without exactly one of each block is a
``ValueError`` naming the marker, never a script with a stale block.
"""

from __future__ import annotations

OPTIONS_BEGIN, OPTIONS_END = "# >>> ckpteval sbatch options", "# <<< ckpteval sbatch options"
SETTINGS_BEGIN, SETTINGS_END = "# >>> ckpteval settings", "# <<< ckpteval settings"


def replace_block(text: str, begin: str, end: str, body: list[str]) -> str:
    """Replace the lines between the marker lines starting with ``begin`` and ``end`` by ``body``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(begin)]
    ends = [i for i, line in enumerate(lines) if line.startswith(end)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"template: expected one block {begin!r} ... {end!r}")
    return "\n".join(lines[: starts[0] + 1] + body + lines[ends[0] :]) + "\n"


def render(template: str, sbatch_lines: list[list[str]], settings: list[str]) -> str:
    """The template with its options block set to ``sbatch_lines`` (one list per het component)."""
    header: list[str] = []
    for index, component in enumerate(sbatch_lines):
        if index:
            header.append("#SBATCH hetjob")
        header += [f"#SBATCH {line}" for line in component]
    text = replace_block(template, OPTIONS_BEGIN, OPTIONS_END, header)
    return replace_block(text, SETTINGS_BEGIN, SETTINGS_END, settings)
