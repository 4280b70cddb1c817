//! The controller's chart and registration (`deploy/gardener/`) are valid YAML. No Helm
//! binary is at hand, so the templates keep to plain `{{ .Values.a.b }}` and
//! `{{ .Release.Namespace }}` substitutions, which this test performs itself from
//! values.yaml: every value a template names must exist there.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/gardener")
}

fn documents(text: &str, what: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{what}: {e}\n{text}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// Replaces each `{{ .Values.x.y }}` and `{{ .Release.Namespace }}`; anything else in
/// braces fails the test (the templates stay that simple).
fn substitute(template: &str, values: &Value, what: &str) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find("}}")
            .unwrap_or_else(|| panic!("{what}: unclosed {{{{"))
            + start;
        let expr = rest[start + 2..end].trim();
        let value = if expr == ".Release.Namespace" {
            "garden-ferry".to_string()
        } else if let Some(path) = expr.strip_prefix(".Values.") {
            let mut v = values;
            for key in path.split('.') {
                v = v
                    .get(key)
                    .unwrap_or_else(|| panic!("{what}: {expr} is not in values.yaml"));
            }
            match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                other => panic!("{what}: {expr} is not a scalar: {other:?}"),
            }
        } else {
            panic!("{what}: {expr:?} is more than a plain substitution");
        };
        out.push_str(&value);
        rest = &rest[end + 2..];
    }
    out.push_str(rest);
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn chart_templates_render_to_kubernetes_objects() {
    let dir = deploy_dir();
    let values = documents(&read(&dir.join("values.yaml")), "values.yaml").remove(0);
    let chart = documents(&read(&dir.join("Chart.yaml")), "Chart.yaml").remove(0);
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "gardener-extension-ferry");

    let mut kinds = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir.join("templates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let what = path.display().to_string();
        assert!(what.ends_with(".yaml"), "{what}: templates are YAML only");
        let rendered = substitute(&read(&path), &values, &what);
        for doc in documents(&rendered, &what) {
            assert!(
                doc["apiVersion"].is_string(),
                "{what}: a document without apiVersion"
            );
            kinds.push(doc["kind"].as_str().unwrap().to_string());
            if doc["kind"] == "Deployment" {
                let c = &doc["spec"]["template"]["spec"]["containers"][0];
                assert_eq!(
                    c["image"],
                    "ghcr.io/ferry-proj/gardener-extension-ferry:0.1.0"
                );
                assert_eq!(c["args"][0], "--ferry-image=ghcr.io/ferry-proj/ferry:0.1.0");
                assert_eq!(c["args"][1], "--leader-election-lease-duration-seconds=15");
                // Leader election: two replicas, rolled one by one.
                assert_eq!(doc["spec"]["replicas"], 2);
                assert_eq!(doc["spec"]["strategy"]["type"], "RollingUpdate");
                let env: Vec<&str> = c["env"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|e| e["name"].as_str().unwrap())
                    .collect();
                for name in ["LEADER_ELECTION_NAMESPACE", "POD_NAME"] {
                    assert!(env.contains(&name), "{name} in {env:?}");
                }
            }
            if doc["kind"] == "ClusterRole" {
                let granted: Vec<String> = doc["rules"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .flat_map(|r| r["resources"].as_sequence().unwrap().clone())
                    .map(|r| r.as_str().unwrap().to_string())
                    .collect();
                for needed in [
                    "networks",
                    "networks/status",
                    "clusters",
                    "managedresources",
                    "secrets",
                    "leases",
                    "events",
                ] {
                    assert!(
                        granted.iter().any(|g| g == needed),
                        "ClusterRole lacks {needed}"
                    );
                }
            }
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "ServiceAccount"
        ]
    );
}

#[test]
fn registration_registers_network_type_ferry() {
    let path = deploy_dir().join("controller-registration.yaml");
    let docs = documents(&read(&path), "controller-registration.yaml");
    assert_eq!(docs.len(), 2);
    let deployment = &docs[0];
    assert_eq!(deployment["apiVersion"], "core.gardener.cloud/v1");
    assert_eq!(deployment["kind"], "ControllerDeployment");
    assert!(deployment["helm"]["ociRepository"]["ref"].is_string());
    let registration = &docs[1];
    assert_eq!(registration["apiVersion"], "core.gardener.cloud/v1beta1");
    assert_eq!(registration["kind"], "ControllerRegistration");
    assert_eq!(
        registration["spec"]["deployment"]["deploymentRefs"][0]["name"],
        deployment["metadata"]["name"]
    );
    let resources = registration["spec"]["resources"].as_sequence().unwrap();
    assert_eq!(resources.len(), 1);
    assert_eq!(resources[0]["kind"], "Network");
    assert_eq!(resources[0]["type"], ferry_gardener::types::NETWORK_TYPE);
    assert_eq!(resources[0]["primary"], true);
}
