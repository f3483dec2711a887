"""Rewrite the Ray wheel in a device wheel folder without the parts kvtune never imports, so that the folder
and the tree fit one GPU call's 64 MiB (run 42: 47.1 → 41.8 MB):

    python lab/scripts/slim_ray_wheel.py .whl

Dropped: ``ray/rllib``, ``ray/serve``, ``ray/llm`` and the dashboard's web client (kvtune starts Ray with
``include_dashboard=False``, ``tuner/local_ray.py``); their lines leave the wheel's RECORD with them.
"""

from __future__ import annotations

import pathlib
import sys
import zipfile

DROP = ("ray/rllib/", "ray/serve/", "ray/llm/", "ray/dashboard/client/")


def slim(wheel: pathlib.Path) -> tuple[int, int]:
    """Rewrite ``wheel`` in place; return its sizes before and after."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if info.filename.startswith(DROP):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith(DROP)]
                data = ("\n".join(kept) + "\n").encode()
            zo.writestr(info, data)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def main() -> None:
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".whl")
    wheels = sorted(folder.glob("ray-*.whl"))
    if not wheels:
        sys.exit(f"slim_ray_wheel: no ray-*.whl in {folder}")
    for wheel in wheels:
        before, after = slim(wheel)
        print(f"{wheel}: {before / 1e6:.1f} → {after / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
