"""`splitinfer cluster status|scale|rollout|rollback|promote`: operate an installed cloud tier.

Thin: parses arguments, connects (in-cluster or kubeconfig, see cluster.k8s.connect) and
calls `cluster.k8s.KubeOps`. See docs/cluster-ops.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the kubernetes client loads only when a command runs
    from cluster.k8s import ClusterStatus

__all__ = ["cluster_main"]


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--namespace", "-n", help="release namespace (default: POD_NAMESPACE, the pod's "
                        "namespace in-cluster, else the kubeconfig context's, else 'default')")
    common.add_argument("--release", help="Helm release name (default: SPLITINFER_RELEASE, else 'splitinfer')")
    common.add_argument("--raycluster", default="", help="RayCluster name (default: the chart's <fullname>-ray)")
    common.add_argument("--configmap", default="",
                        help="registry ConfigMap (default: SPLITINFER_REGISTRY_CONFIGMAP, else <release>-registry)")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: KUBECONFIG, else ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument("--config-source", choices=("auto", "in-cluster", "kubeconfig"), default="auto",
                        help="auto: the pod's service account when run in a pod, else the kubeconfig")
    p = argparse.ArgumentParser(prog="splitinfer cluster", description="Operate the cloud tier on Kubernetes.")
    sub = p.add_subparsers(dest="op", required=True)
    s = sub.add_parser("status", parents=[common], help="pods, GPUs per node, worker groups, model rollouts")
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s = sub.add_parser("scale", parents=[common], help="set a Ray worker group's replicas")
    s.add_argument("--group", required=True, help="worker group name (the chart's are 'cpu' and 'gpu')")
    s.add_argument("--replicas", required=True, type=int, help="within the group's [minReplicas, maxReplicas]")
    s = sub.add_parser("rollout", parents=[common], help="send a share of devices to MODEL@VERSION (canary)")
    s.add_argument("target", metavar="MODEL@VERSION")
    s.add_argument("--canary", required=True, help="share of devices, e.g. 10%%")
    s.add_argument("--default", dest="default_version",
                   help="the version the other devices keep, when the ConfigMap records none yet")
    s = sub.add_parser("rollback", parents=[common], help="end MODEL's canary: every device gets the default")
    s.add_argument("model", metavar="MODEL")
    s = sub.add_parser("promote", parents=[common], help="make MODEL's canary the default for every device")
    s.add_argument("model", metavar="MODEL")
    return p


def _print_status(st: ClusterStatus) -> None:
    print(f"release {st.release} in namespace {st.namespace}")
    print("\nPODS")
    print(f"  {'NAME':<44} {'COMPONENT':<11} {'GROUP':<6} {'PHASE':<9} {'READY':<5} {'RESTARTS':>8}  NODE")
    for p in st.pods:
        print(f"  {p.name:<44} {p.component:<11} {p.group or '-':<6} {p.phase:<9} "
              f"{'yes' if p.ready else 'no':<5} {p.restarts:>8}  {p.node or '-'}")
    if not st.pods:
        print("  (none)")
    print("\nRAY WORKER GROUPS")
    for g in st.worker_groups:
        print(f"  {g.name:<10} replicas {g.replicas} (min {g.min_replicas}, max {g.max_replicas})")
    if not st.worker_groups:
        print("  (none)")
    print("\nGPUS PER NODE (allocatable / capacity nvidia.com/gpu)")
    for n in st.nodes:
        print(f"  {n.node:<44} {n.gpus_allocatable} / {n.gpus_capacity}")
    if not st.nodes:
        print("  (none)")
    print("\nMODELS (registry ConfigMap)")
    for m in st.models:
        canary = f", canary {m.canary_version} to {m.canary_percent:g}% of devices" if m.canary_version else ""
        policy = json.dumps(m.version_policy) if m.version_policy is not None else "gateway default"
        print(f"  {m.model:<20} default {m.default_version or '(highest loaded)'}{canary}; loads {policy}")
    if not st.models:
        print("  (none recorded)")
    for note in st.notes:
        print(f"\nnote: {note}")


def cluster_main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    from cluster import k8s  # the kubernetes client is imported only here

    env = os.environ
    source = k8s.choose_config_source(args.config_source, env)
    kubeconfig = args.kubeconfig or None
    namespace = args.namespace or k8s.default_namespace(source, kubeconfig, args.context, env)
    release = args.release or env.get("SPLITINFER_RELEASE") or "splitinfer"
    configmap = args.configmap or (env.get("SPLITINFER_REGISTRY_CONFIGMAP", "") if not args.release else "")
    target = k8s.ClusterTarget(namespace=namespace, release=release, raycluster=args.raycluster,
                               configmap=configmap)
    ops = k8s.KubeOps(k8s.connect(source, kubeconfig=kubeconfig, context=args.context), target)

    if args.op == "status":
        st = ops.status()
        if args.json:
            print(st.to_json())
        else:
            _print_status(st)
    elif args.op == "scale":
        g = ops.scale(args.group, args.replicas)
        print(f"worker group {g.name} of {target.namespace}/{target.raycluster_name}: replicas {g.replicas} "
              f"(min {g.min_replicas}, max {g.max_replicas}); KubeRay starts or stops the pods")
    elif args.op == "rollout":
        model, sep, version = args.target.partition("@")
        if not sep or not model or not version:
            print(f"splitinfer cluster rollout: {args.target!r} is not MODEL@VERSION, e.g. resnet50@2",
                  file=sys.stderr)
            return 2
        percent = k8s.parse_percent(args.canary)
        ops.rollout(model, version, percent, default_version=args.default_version)
        print(f"{model}@{version} now goes to {percent:g}% of devices "
              f"(recorded in configmap {target.namespace}/{target.configmap_name})")
    elif args.op == "rollback":
        removed = ops.rollback(args.model)
        print(f"{args.model}: canary {removed} rolled back; every device gets the default version"
              if removed else f"{args.model}: there was no canary; nothing to roll back")
    else:
        version = ops.promote(args.model)
        print(f"{args.model}@{version} is now the default version for every device")
    return 0


if __name__ == "__main__":
    sys.exit(cluster_main(sys.argv[1:]))
