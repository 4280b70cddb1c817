//! deploy/ferry.yaml is valid YAML and keeps its promises: least privilege (no
//! `privileged`, every capability dropped and only the agent's added back, read-only
//! RBAC), Gardener's node-critical label and tolerations, the NODE_NAME env, the probes.
//! No root needed.

use std::collections::BTreeSet;

use serde::Deserialize;
use serde_yaml::Value;

fn docs() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/ferry.yaml");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{path} is not valid YAML: {e}")))
        .collect()
}

fn get<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, k| {
        v.get(k)
            .unwrap_or_else(|| panic!("deploy/ferry.yaml: no `{path}` (missing `{k}`)"))
    })
}

fn strs(v: &Value) -> BTreeSet<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("expected a list, saw {v:?}"))
        .iter()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d.get("kind").and_then(Value::as_str) == Some(kind))
        .unwrap_or_else(|| panic!("deploy/ferry.yaml has no {kind}"))
}

/// Every mapping key anywhere in `v`, with its value.
fn walk<'a>(v: &'a Value, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Mapping(m) => {
            for (k, val) in m {
                out.push((k.as_str().unwrap_or_default().to_string(), val));
                walk(val, out);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|x| walk(x, out)),
        _ => {}
    }
}

#[test]
fn objects_and_rbac_are_read_only() {
    let docs = docs();
    let kinds: Vec<&str> = docs
        .iter()
        .map(|d| get(d, "kind").as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet"
        ]
    );
    let mut granted = BTreeSet::new();
    for rule in get(kind(&docs, "ClusterRole"), "rules")
        .as_sequence()
        .unwrap()
    {
        for group in strs(get(rule, "apiGroups")) {
            for res in strs(get(rule, "resources")) {
                for verb in strs(get(rule, "verbs")) {
                    granted.insert(format!("{group}/{res}:{verb}"));
                }
            }
        }
    }
    assert_eq!(
        granted,
        set(&[
            "/services:list",
            "/services:watch",
            "/nodes:get",
            "/nodes:list",
            "/nodes:watch",
            "discovery.k8s.io/endpointslices:list",
            "discovery.k8s.io/endpointslices:watch",
        ]),
        "the ClusterRole must grant exactly list/watch of Services and EndpointSlices and get/list/watch of Nodes"
    );
    let ds = kind(&docs, "DaemonSet");
    assert_eq!(get(ds, "metadata.namespace").as_str(), Some("kube-system"));
    let binding = kind(&docs, "ClusterRoleBinding");
    assert_eq!(get(binding, "roleRef.name").as_str(), Some("ferry"));
}

#[test]
fn daemonset_is_node_critical_and_least_privileged() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let label = "node.gardener.cloud/critical-component";
    for at in ["metadata.labels", "spec.template.metadata.labels"] {
        assert_eq!(
            get(ds, at).get(label).and_then(Value::as_str),
            Some("true"),
            "{at} must carry {label}: \"true\" (Gardener node readiness)"
        );
    }
    let pod = get(ds, "spec.template.spec");
    assert_eq!(get(pod, "hostNetwork").as_bool(), Some(true));
    assert_eq!(
        get(pod, "priorityClassName").as_str(),
        Some("system-node-critical")
    );
    let tolerations = get(pod, "tolerations").as_sequence().unwrap();
    assert!(
        tolerations.iter().any(
            |t| t.get("operator").and_then(Value::as_str) == Some("Exists")
                && t.get("key").is_none()
        ),
        "must tolerate every taint (operator: Exists without key): {tolerations:?}"
    );
    assert!(
        tolerations
            .iter()
            .any(|t| t.get("key").and_then(Value::as_str)
                == Some("node.gardener.cloud/critical-components-not-ready")),
        "must name Gardener's critical-components-not-ready taint: {tolerations:?}"
    );

    let mut keys = Vec::new();
    walk(ds, &mut keys);
    assert!(
        !keys.iter().any(|(k, _)| k == "privileged"),
        "`privileged` must not appear in the DaemonSet"
    );
    assert!(
        !keys
            .iter()
            .any(|(k, v)| k == "hostPID" && v.as_bool() == Some(true)),
        "no hostPID: pod namespaces are found in the runtime's /run/netns"
    );
    assert!(
        !keys.iter().any(|(k, _)| k == "initContainers"),
        "no init containers (the agent needs no privileged set-up step)"
    );

    let containers = get(pod, "containers").as_sequence().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(
        get(c, "image").as_str(),
        Some(format!("ghcr.io/ferry-proj/ferry:{}", env!("CARGO_PKG_VERSION")).as_str()),
        "the image `cargo xtask image` names"
    );
    let caps = get(c, "securityContext.capabilities");
    assert_eq!(strs(get(caps, "drop")), set(&["ALL"]));
    let added = strs(get(caps, "add"));
    for need in ["BPF", "PERFMON", "NET_ADMIN"] {
        assert!(added.contains(need), "capability {need} missing: {added:?}");
    }
    let allowed = set(&["BPF", "PERFMON", "NET_ADMIN", "SYS_ADMIN", "NET_RAW"]);
    assert!(
        added.is_subset(&allowed),
        "capabilities beyond the reviewed set: {:?}",
        added.difference(&allowed).collect::<Vec<_>>()
    );
    assert_eq!(
        get(c, "securityContext.allowPrivilegeEscalation").as_bool(),
        Some(false)
    );

    let env = get(c, "env").as_sequence().unwrap();
    let node_name = env
        .iter()
        .find(|e| get(e, "name").as_str() == Some("NODE_NAME"))
        .expect("env NODE_NAME");
    assert_eq!(
        get(node_name, "valueFrom.fieldRef.fieldPath").as_str(),
        Some("spec.nodeName")
    );
    for var in ["KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"] {
        assert!(
            env.iter().any(|e| get(e, "name").as_str() == Some(var)),
            "{var} must be set to the API server's real address"
        );
    }
    for (probe, path) in [("readinessProbe", "/healthz"), ("livenessProbe", "/livez")] {
        assert_eq!(
            get(c, &format!("{probe}.httpGet.path")).as_str(),
            Some(path)
        );
        assert_eq!(
            get(c, &format!("{probe}.httpGet.port")).as_u64(),
            Some(10256)
        );
    }

    // The host mounts, and that none of them is writable beyond the bpffs.
    let mounts = get(c, "volumeMounts").as_sequence().unwrap();
    let path_of = |name: &str| {
        mounts
            .iter()
            .find(|m| get(m, "name").as_str() == Some(name))
            .unwrap_or_else(|| panic!("no volumeMount {name}"))
    };
    assert_eq!(
        get(path_of("bpffs"), "mountPath").as_str(),
        Some("/sys/fs/bpf")
    );
    assert_eq!(
        get(path_of("cgroup"), "readOnly").as_bool(),
        Some(true),
        "the cgroup root is only opened, never written"
    );
    let args = strs(get(c, "args"));
    assert!(args.contains("agent"), "args: {args:?}");
    assert!(
        args.contains("--cgroup=/run/ferry/cgroupv2"),
        "the agent must use the mounted cgroup root: {args:?}"
    );
    // It replaces kube-proxy: the takeover runs, with the node's iptables lock.
    assert!(args.contains("--takeover-kube-proxy"), "args: {args:?}");
    assert_eq!(
        get(path_of("xtables-lock"), "mountPath").as_str(),
        Some("/run/xtables.lock")
    );
    let volumes = get(pod, "volumes").as_sequence().unwrap();
    let lock = volumes
        .iter()
        .find(|v| get(v, "name").as_str() == Some("xtables-lock"))
        .expect("volume xtables-lock");
    assert_eq!(
        get(lock, "hostPath.path").as_str(),
        Some("/run/xtables.lock")
    );
    assert_eq!(get(lock, "hostPath.type").as_str(), Some("FileOrCreate"));
}
