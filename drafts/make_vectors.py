"""Write the draft's test-vector appendix from tests/vectors/*.json.

python drafts/make_vectors.py            # writes drafts/vectors.md
python drafts/make_vectors.py --check    # exit 1 if drafts/vectors.md is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from catsproto.draft import VECTOR_FILES, vectors_from_files  # noqa: E402

OUT = ROOT / "drafts" / "vectors.md"


def generate() -> str:
    vectors = ROOT / "tests" / "vectors"
    return vectors_from_files(
        {name: (vectors / f"{name}.json").read_text() for name in VECTOR_FILES}
    )


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python drafts/make_vectors.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
