"""MkDocs hook: the repository's own documents that the manual links to (the benchmark reports, the demo
model's card and loss curve, the kernel's README) join the build under their own paths, so a link written
for GitHub (`../benchmarks/README.md` from a page in docs/) works on the site too, and `--strict` checks it."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

# globs relative to the repository root; each file keeps its path, as `../<path>` seen from docs/
INCLUDE = [
    "benchmarks/README.md",
    "benchmarks/results/*/*.md",
    "benchmarks/results/*/*.png",
    "models/andrea-tiny-demo/README.md",
    "models/andrea-tiny-demo/loss.png",
    "plugins/gelu_tanh/README.md",
]


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    for pattern in INCLUDE:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            src_uri = f"../{rel}"  # what a page in docs/ links to
            f = File(src_uri, str(docs), config["site_dir"], config["use_directory_urls"],
                     inclusion=InclusionLevel.INCLUDED)
            dest = f.dest_uri.removeprefix("../")  # on the site: under repo/, beside the manual's own pages
            f.dest_uri = f"repo/{dest}"
            files.append(f)
    return files
