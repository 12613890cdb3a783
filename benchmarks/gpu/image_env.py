"""An environment built the way the lent GPU image is, for the suite's CPU rehearsal: a
fresh venv holding only the packages the image holds (image_packages.txt), taken from this
machine's venv (its plain CPU torch among them) by linking their files, and nothing else:
not the splitserve checkout, not msgspec, redis, xgrammar or the bundled model. The
rehearsal then puts the bundle on PYTHONPATH as suite.sh does on the GPU machine, so a
package the bundle forgets fails there as it would on the device.

    python -m splitserve.benchmarks.gpu.image_env DIR    # prints DIR/bin/python

This machine's versions of the image's packages can need packages the image's versions do
not (transformers here pulls a newer huggingface_hub, which imports httpx2): what they
require is linked too, except the carried packages, which must come from the bundle.
Linking instead of installing takes a second and needs no network; the image's own
versions are recorded on the device by the suite's probe.
"""

import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

from splitserve.benchmarks.gpu.manifest import carried, image_packages, normalize


def top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution puts directly in site-packages (packages, modules, its
    .dist-info, bundled .libs), not scripts outside it."""
    names = set()
    for f in dist.files or []:
        top = f.parts[0]
        if top not in ("..", "__pycache__") and not top.endswith(".pth"):
            names.add(top)
    return names


def linked(site: Path) -> list[importlib.metadata.Distribution]:
    """The image's packages installed in ``site`` and, transitively, what they require
    there, less the carried packages."""
    dists = {normalize(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    excluded = {normalize(name) for name, _ in carried()}
    todo = [name for name in image_packages() if name in dists and name not in excluded]
    seen = set(todo)
    while todo:
        for text in dists[todo.pop()].requires or []:
            req = Requirement(text)
            name = normalize(req.name)
            if (name in dists and name not in seen and name not in excluded
                    and (req.marker is None or req.marker.evaluate({"extra": ""}))):
                seen.add(name)
                todo.append(name)
    return [dists[name] for name in sorted(seen)]


def build(venv: Path) -> Path:
    """Makes ``venv`` and returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for dist in linked(ours):
        for name in top_level_entries(dist):
            src, dst = ours / name, target / name
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return python


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m splitserve.benchmarks.gpu.image_env DIR")
    print(build(Path(sys.argv[1])))
