"""Give a stopped node dockerd the host engine's images as hard links: seconds, not a `docker load`.

    python3 link_images.py NODE_DATA_ROOT IMAGE...

Both engines must use the overlay2 storage driver with their data roots on one
filesystem; exit status 3 (and one line) says when they do not or a link
fails, and the caller then falls back to `docker save | docker load`. A link
never crosses mount points, and /var/lib/docker is often a bind mount of its
own, so the work is done under a second mount of the whole filesystem. The node's dockerd must be
stopped (it reads its image store when it starts).

What an overlay2 engine keeps of an image, all linked here:
- image/overlay2/imagedb/content/sha256/<id>: the image's config;
- image/overlay2/layerdb/sha256/<chain id>/: each layer (its `cache-id` names
  the directory below), the chain id being sha256 of "<parent chain id> <diff id>";
- overlay2/<cache id>/ (diff/, link, lower) and overlay2/l/<link>: the files;
- image/overlay2/repositories.json: the tags.

A layer's files never change once committed (a container writes to an upper
layer of its own), so a link shares them safely between the engines; removing
the image on either side removes only that side's names.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile


def inspect(fmt: str, *args: str) -> str:
    return subprocess.run(["docker", *args, "-f", fmt], check=True, capture_output=True, text=True).stdout.strip()


def chain_ids(diff_ids: list[str]) -> list[str]:
    chain = [diff_ids[0]]
    for diff in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff}".encode()).hexdigest())
    return chain


def link_tree(src: str, dst: str) -> None:
    """A directory of hard links, nothing if dst exists. `cp -al`: the directories it makes
    keep their owner, mode and xattrs (overlay's opaque marks), which shutil.copytree drops."""
    if not os.path.exists(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        subprocess.run(["cp", "-al", src, dst], check=True)


def on_device(path: str) -> tuple[str, str, str]:
    """(device, filesystem type, path inside that filesystem) of `path`."""
    out = subprocess.run(
        ["findmnt", "-n", "--nofsroot", "-o", "SOURCE,FSTYPE,FSROOT,TARGET", "-T", path],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    device, fstype, fsroot, target = out[:4]
    inside = os.path.normpath(os.path.join(fsroot, os.path.relpath(os.path.realpath(path), target)))
    return device, fstype, inside


def main(node_root: str, images: list[str]) -> int:
    host_root, driver = inspect("{{.DockerRootDir}} {{.Driver}}", "info").split()
    os.makedirs(node_root, exist_ok=True)
    (dev, fstype, host_in), (node_dev, _, node_in) = on_device(host_root), on_device(node_root)
    if driver != "overlay2" or dev != node_dev or not dev.startswith("/dev/"):
        print(
            f"link_images: cannot link ({driver} at {host_root} on {dev}, node at {node_root} on {node_dev}: "
            "needs overlay2 on one filesystem)",
            file=sys.stderr,
        )
        return 3
    whole = tempfile.mkdtemp(prefix="psc-link-")
    subprocess.run(["mount", "-t", fstype, dev, whole], check=True)
    try:
        return link(os.path.join(whole, host_in.lstrip("/")), os.path.join(whole, node_in.lstrip("/")), images)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"link_images: cannot link: {error}", file=sys.stderr)
        return 3
    finally:
        subprocess.run(["umount", whole], check=False)
        os.rmdir(whole)


def link(host_root: str, node_root: str, images: list[str]) -> int:
    src_db, dst_db = (os.path.join(r, "image", "overlay2") for r in (host_root, node_root))
    os.makedirs(os.path.join(node_root, "overlay2", "l"), exist_ok=True)
    repos_path = os.path.join(dst_db, "repositories.json")
    repos = json.load(open(repos_path)) if os.path.exists(repos_path) else {"Repositories": {}}
    for image in images:
        image_id, layers = inspect("{{.Id}} {{json .RootFS.Layers}}", "image", "inspect", image).split(" ", 1)
        digest = image_id.split(":", 1)[1]
        for part in ("content", "metadata"):
            src = os.path.join(src_db, "imagedb", part, "sha256", digest)
            if os.path.exists(src):
                dst = os.path.join(dst_db, "imagedb", part, "sha256", digest)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if os.path.isdir(src):
                    link_tree(src, dst)
                elif not os.path.exists(dst):
                    os.link(src, dst)
        for chain in chain_ids(json.loads(layers)):
            hexid = chain.split(":", 1)[1]
            src_layer = os.path.join(src_db, "layerdb", "sha256", hexid)
            link_tree(src_layer, os.path.join(dst_db, "layerdb", "sha256", hexid))
            cache_id = open(os.path.join(src_layer, "cache-id")).read().strip()
            link_tree(os.path.join(host_root, "overlay2", cache_id), os.path.join(node_root, "overlay2", cache_id))
            short = open(os.path.join(host_root, "overlay2", cache_id, "link")).read().strip()
            short_link = os.path.join(node_root, "overlay2", "l", short)
            if not os.path.lexists(short_link):
                os.symlink(os.path.join("..", cache_id, "diff"), short_link)
        for tag in json.loads(inspect("{{json .RepoTags}}", "image", "inspect", image)):
            name = tag.rsplit(":", 1)[0]
            repos["Repositories"].setdefault(name, {})[tag] = image_id
    tmp = repos_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(repos, f)
    os.replace(tmp, repos_path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print("usage: link_images.py NODE_DATA_ROOT IMAGE...", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
