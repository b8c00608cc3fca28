"""The quickstart end to end with every pod, and the operator, running inside the built images.

The node agent runs in image mode (``--images``): each container runs inside the root filesystem
of its pod's image, resolved from the local tags ``images/build.sh`` builds, so
``kubectl apply -f examples/quickstart.yaml`` exercises the images' own Python, packages and
entrypoints, not this checkout's virtualenv. The chart is installed with its image values set to
those local tags; the operator runs inside the operator image with the Deployment's args, env
and user. The shared fixture folder is the node's read-only data, mounted beside the containers'
working dir, so the quickstart's ``../shared`` paths resolve as they do for ``packtrain run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from cluster import rootfs
from cluster.controlplane import ControlPlane, _die_with_parent, ensure_addons
from e2e_harness import (
    QUICKSTART,
    RELEASE_NS,
    REPO,
    Harness,
    control_plane_binaries,
    free_trainer_port,
    in_ci,
    of_kind,
    quickstart_docs,
    running,
    stamp,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "quickstart"
PACK_TIMEOUT = 600
TRAIN_TIMEOUT = 900
KUBECONFIG_MOUNT = "/var/run/packtrain/kubeconfig"


def local_tag_values() -> dict[str, object]:
    """Chart values that point the operator and its workloads at the local tags."""

    def ref(name: str) -> dict[str, str]:
        repository, _, tag = rootfs.IMAGE_TAGS[name].rpartition(":")
        return {"repository": repository, "tag": tag}

    return {"image": ref("operator"), "workloadImages": {"packer": ref("packer"), "trainer": ref("trainer")}}


@dataclass
class ImageHarness(Harness):
    """The e2e harness whose operator runs inside the operator image."""

    operator_image: rootfs.Image | None = None
    images: dict[str, rootfs.Image] = field(default_factory=dict)

    def start_operator(self) -> None:
        assert self.operator_kubeconfig is not None and self.operator_image is not None, (
            "install_chart() first"
        )
        image = self.operator_image
        pod = self.deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
        os.chown(self.operator_kubeconfig, uid, gid)
        env = {
            **image.env,
            **{e["name"]: e["value"] for e in container["env"] if "value" in e},
            "KUBECONFIG": KUBECONFIG_MOUNT,
            "POD_NAMESPACE": RELEASE_NS,
        }
        self.operator_starts += 1
        argv = rootfs.container_argv(
            image,
            [*image.entrypoint, *container["args"]],
            scratch=self.work / f"operator-rootfs{self.operator_starts}",
            env=env,
            mounts=[rootfs.Mount(str(self.operator_kubeconfig), KUBECONFIG_MOUNT, read_only=True)],
            uid=uid,
            gid=gid,
        )
        with self.operator_log.open("ab") as log:
            log.write(f"--- operator start #{self.operator_starts} at {stamp()} in {image.ref}\n".encode())
            log.flush()
            self.operator = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )


@pytest.fixture(scope="module")
def e2e_images(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, shared_dir: Path
) -> Iterator[ImageHarness]:
    if os.environ.get("PACKTRAIN_SKIP_CLUSTER") == "1" and not in_ci():
        pytest.skip("cluster tests skipped because PACKTRAIN_SKIP_CLUSTER=1")
    try:
        images = rootfs.ensure_built()
    except rootfs.ImagesUnavailable as e:
        if in_ci():
            pytest.fail(f"CI must build the images, but: {e}")
        pytest.skip(f"SKIPPED LOUDLY: the images cannot be built on this machine: {e}")
    # `.ci/run` runs this module last in `--part rest`, which starts while the control plane builds.
    ensure_addons()
    bin_dir, crd_dir = control_plane_binaries()
    # Inside the containers the shared folder sits where it does here and the working dir is the
    # checkout's path (an empty folder in the image): ../shared resolves, and reject details, which
    # name media paths, read as they do for the checkout's own pack.
    workdir = str(shared_dir.parent / REPO.name)
    agent_args = ["--run-all", "--images", "--workdir", workdir, "--mount", f"{shared_dir}:{shared_dir}"]
    cp = ControlPlane(bin_dir, crd_dir, node_agent_args=agent_args)
    yield from running(
        request,
        tmp_path_factory.mktemp("e2e-images"),
        cp,
        ImageHarness,
        chart_values=local_tag_values(),
        operator_image=images["operator"],
        images=images,
    )


def test_quickstart_runs_in_the_images(
    e2e_images: ImageHarness, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h, ns = e2e_images, "quickstart-images"
    docs = quickstart_docs()
    free_trainer_port(of_kind(docs, "SFTJob"))
    h.namespace_with_claims(ns)
    t0 = time.monotonic()
    h.cp.kubectl("apply", "-n", ns, "-f", str(QUICKSTART))
    assert h.wait_phase("packjobs", ns, NAME, ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        h.diagnostics(ns)
    )
    pack_seconds = time.monotonic() - t0
    assert h.wait_phase("sftjobs", ns, NAME, ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
        h.diagnostics(ns)
    )
    seconds = time.monotonic() - t0

    # Every container of every pod ran inside its image's files, as the pod's user.
    by_ref = {img.ref: img for img in h.images.values()}
    ran: list[tuple[str, str]] = []
    for pod in h.core.list_namespaced_pod(ns).items:
        for c in pod.spec.containers:
            image = by_ref.get(c.image)
            assert image is not None, f"{pod.metadata.name}: image {c.image} is not a local tag"
            (spec_file,) = (h.pod_dir(ns, pod.metadata.name) / f"{c.name}.rootfs0").glob("spec.json")
            spec = json.loads(spec_file.read_text())
            assert spec["layers"] == list(image.layers) and spec["uid"] == 65532, pod.metadata.name
            assert spec["env"]["PATH"].startswith("/opt/packtrain/bin:")
            ran.append((pod.metadata.name, c.image))
    assert {img for _, img in ran} == {rootfs.IMAGE_TAGS["packer"], rootfs.IMAGE_TAGS["trainer"]}, ran

    # The pack equals the checkout's own pack of the same PackJob, byte for byte.
    packjob = h.get("packjobs", ns, NAME)
    mount = packjob["spec"]["output"].get("mountPath", "/data")
    pack = h.pvc_dir(ns, "packtrain-data") / Path(packjob["status"]["outputPath"]).relative_to(mount)
    config = tmp_path / "packjob.yaml"
    config.write_text(yaml.safe_dump(of_kind(docs, "PackJob")))
    host = subprocess.run(
        [
            str(Path(sys.executable).with_name("packtrain")),
            "pack",
            "run",
            "-c",
            str(config),
            "-o",
            str(tmp_path / "host"),
            "--workers",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert host.returncode == 0, host.stderr[-3000:]
    assert (pack / "manifest.json").read_bytes() == (tmp_path / "host" / "manifest.json").read_bytes()

    progress = h.get("sftjobs", ns, NAME)["status"]["progress"]
    max_steps = of_kind(docs, "SFTJob")["spec"]["training"]["maxSteps"]
    assert progress["step"] == max_steps and progress["loss"] > 0, progress
    assert "in localhost/packtrain/operator:dev" in h.operator_log.read_text()
    with capsys.disabled():
        print(
            f"\nquickstart in the images: {len(ran)} containers, pack {pack_seconds:.0f} s, "
            f"apply -> SFTJob Succeeded {seconds:.0f} s, {progress['step']} steps, "
            f"loss {progress['loss']:.4f}"
        )
