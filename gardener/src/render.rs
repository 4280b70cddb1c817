//! The manifests ferry needs in the shoot, rendered from `deploy/ferry.yaml`: the very
//! template the deployment tests run under containerd (`tests/tests/container.rs`), embedded
//! at build time and patched as data, never as text.
//!
//! What the patch changes in the DaemonSet's `ferry` container:
//! - the image (from the extension's `--ferry-image`);
//! - `KUBERNETES_SERVICE_HOST`/`PORT`: the shoot's `external` advertised address, so the
//!   agent never depends on a ClusterIP to reach the API server (without the address,
//!   possible only while kube-proxy runs, both are dropped and the in-cluster defaults
//!   apply);
//! - the pod network: `--pod-network`, the CNI directories, overlay, masquerade, MTU, with
//!   the host directories they need mounted;
//! - Service routing: with kube-proxy kept, `--takeover-kube-proxy` is dropped and
//!   `--service-routing=false` added;
//! - map capacities from the providerConfig.

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Container, EnvVar, HostPathVolumeSource, Volume, VolumeMount},
};
use serde::Deserialize;
use serde_json::Value;

use crate::{
    config::NetworkConfig,
    decide::{Decision, ServiceRouting},
};

/// The DaemonSet and its RBAC, as proven on a real container runtime.
pub const TEMPLATE: &str = include_str!("../../deploy/ferry.yaml");

/// The agent container in the template's DaemonSet.
const CONTAINER: &str = "ferry";

/// Host directories of the pod network: (volume name, host path, path in the container).
const POD_NETWORK_MOUNTS: [(&str, &str, &str); 3] = [
    ("cni-conf", "/etc/cni/net.d", "/host/etc/cni/net.d"),
    ("cni-bin", "/opt/cni/bin", "/host/opt/cni/bin"),
    ("ferry-state", "/var/lib/ferry", "/var/lib/ferry"),
];

/// The image the template names: the default of `--ferry-image`.
pub fn default_image() -> String {
    format!("ghcr.io/ferry-proj/ferry:{}", env!("CARGO_PKG_VERSION"))
}

/// The embedded template is not what this renderer expects: a build of a broken template.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("deploy/ferry.yaml: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("deploy/ferry.yaml: {0}")]
    Json(#[from] serde_json::Error),
    #[error("deploy/ferry.yaml: {0}")]
    Template(String),
}

/// Renders the shoot manifests as one multi-document YAML stream.
pub fn render(
    decision: &Decision,
    config: &NetworkConfig,
    image: &str,
) -> Result<String, RenderError> {
    let mut out = String::new();
    let mut daemonsets = 0;
    for document in serde_yaml::Deserializer::from_str(TEMPLATE) {
        let mut doc = Value::deserialize(document)?;
        if doc.is_null() {
            continue;
        }
        if doc["kind"] == "DaemonSet" {
            let mut ds: DaemonSet = serde_json::from_value(doc)?;
            patch_daemonset(&mut ds, decision, config, image)?;
            doc = serde_json::to_value(&ds)?;
            daemonsets += 1;
        }
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&doc)?);
    }
    if daemonsets != 1 {
        return Err(RenderError::Template(format!(
            "{daemonsets} DaemonSets, expected one"
        )));
    }
    Ok(out)
}

fn patch_daemonset(
    ds: &mut DaemonSet,
    decision: &Decision,
    config: &NetworkConfig,
    image: &str,
) -> Result<(), RenderError> {
    let pod = ds
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .ok_or_else(|| RenderError::Template("the DaemonSet has no pod spec".into()))?;
    let container = pod
        .containers
        .iter_mut()
        .find(|c| c.name == CONTAINER)
        .ok_or_else(|| {
            RenderError::Template(format!("the DaemonSet has no container {CONTAINER:?}"))
        })?;
    container.image = Some(image.to_string());
    set_api_server_env(container, decision)?;
    container
        .args
        .get_or_insert_default()
        .extend(agent_args(decision, config));
    if decision.service_routing == ServiceRouting::KubeProxy {
        // kube-proxy stays: leave its rules alone.
        if let Some(args) = container.args.as_mut() {
            args.retain(|a| a != "--takeover-kube-proxy");
        }
    }
    let mounts = container.volume_mounts.get_or_insert_default();
    let volumes = pod.volumes.get_or_insert_default();
    for (name, host, mount) in POD_NETWORK_MOUNTS {
        mounts.push(VolumeMount {
            name: name.to_string(),
            mount_path: mount.to_string(),
            ..VolumeMount::default()
        });
        volumes.push(Volume {
            name: name.to_string(),
            host_path: Some(HostPathVolumeSource {
                path: host.to_string(),
                type_: Some("DirectoryOrCreate".to_string()),
            }),
            ..Volume::default()
        });
    }
    Ok(())
}

/// The arguments added to the template's.
fn agent_args(decision: &Decision, config: &NetworkConfig) -> Vec<String> {
    let mut args = vec![
        "--pod-network".to_string(),
        format!("--cni-conf-dir={}", POD_NETWORK_MOUNTS[0].2),
        format!("--cni-bin-dir={}", POD_NETWORK_MOUNTS[1].2),
    ];
    if config.overlay {
        args.push("--overlay=vxlan".to_string());
    }
    if !config.masquerade {
        args.push("--masquerade=false".to_string());
    }
    if let Some(mtu) = config.mtu {
        args.push(format!("--mtu={mtu}"));
    }
    if decision.service_routing == ServiceRouting::KubeProxy {
        args.push("--service-routing=false".to_string());
    }
    if let Some(n) = config.max_services {
        args.push(format!("--max-services={n}"));
    }
    // The agent calls the endpoint map's entries backends.
    if let Some(n) = config.max_endpoints {
        args.push(format!("--max-backends={n}"));
    }
    args
}

/// Points `KUBERNETES_SERVICE_HOST`/`PORT` at the API server's address, or drops both when
/// there is none (kube-proxy runs, so the in-cluster ClusterIP works).
fn set_api_server_env(container: &mut Container, decision: &Decision) -> Result<(), RenderError> {
    let env = container.env.get_or_insert_default();
    let names = ["KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"];
    let Some(api) = &decision.api_server else {
        env.retain(|e| !names.contains(&e.name.as_str()));
        return Ok(());
    };
    for (name, value) in names
        .into_iter()
        .zip([api.host.clone(), api.port.to_string()])
    {
        let var: &mut EnvVar = env.iter_mut().find(|e| e.name == name).ok_or_else(|| {
            RenderError::Template(format!("the {CONTAINER:?} container has no {name} env"))
        })?;
        var.value = Some(value);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ApiServerAddress, IpFamily};
    use std::path::PathBuf;

    fn api() -> Option<ApiServerAddress> {
        Some(ApiServerAddress {
            host: "api.bar.foo.example.com".into(),
            port: 443,
        })
    }

    /// The three reviewed cases: (golden file, decision, providerConfig).
    fn cases() -> Vec<(&'static str, Decision, NetworkConfig)> {
        vec![
            (
                "ipv4-kube-proxy-disabled.yaml",
                Decision {
                    service_routing: ServiceRouting::Ferry,
                    ip_families: vec![IpFamily::IPv4],
                    api_server: api(),
                },
                NetworkConfig::default(),
            ),
            (
                "dual-stack-overlay.yaml",
                Decision {
                    service_routing: ServiceRouting::Ferry,
                    ip_families: vec![IpFamily::IPv4, IpFamily::IPv6],
                    api_server: Some(ApiServerAddress {
                        host: "api.bar.foo.example.com".into(),
                        port: 8443,
                    }),
                },
                NetworkConfig {
                    overlay: true,
                    masquerade: false,
                    mtu: Some(1450),
                    max_services: Some(100000),
                    max_endpoints: Some(200000),
                    ..NetworkConfig::default()
                },
            ),
            (
                "kube-proxy-enabled.yaml",
                Decision {
                    service_routing: ServiceRouting::KubeProxy,
                    ip_families: vec![IpFamily::IPv4],
                    api_server: None,
                },
                NetworkConfig::default(),
            ),
        ]
    }

    /// Compares with `gardener/testdata/<name>`; `UPDATE_GOLDEN=1` rewrites the files.
    #[test]
    fn golden_manifests() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata");
        let update = std::env::var_os("UPDATE_GOLDEN").is_some();
        for (name, decision, config) in cases() {
            let got = render(&decision, &config, &default_image()).unwrap();
            let path = dir.join(name);
            if update {
                std::fs::write(&path, &got).unwrap();
                continue;
            }
            let want = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
            assert!(
                got == want,
                "{name} differs from the golden file (UPDATE_GOLDEN=1 rewrites it, then review the diff)\n--- got\n{got}"
            );
        }
    }

    /// The agent's command line as source text: every flag the renderer emits must be
    /// one of its `AgentArgs` fields (clap's `long` names are the fields in kebab case).
    const AGENT_MAIN: &str = include_str!("../../agent/src/main.rs");

    #[test]
    fn every_rendered_flag_is_an_agent_flag() {
        let start = AGENT_MAIN
            .find("struct AgentArgs {")
            .expect("AgentArgs in agent/src/main.rs");
        let end = start
            + AGENT_MAIN[start..]
                .find("\n}")
                .expect("the end of AgentArgs");
        let agent_args = &AGENT_MAIN[start..end];
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata");
        let mut checked = 0;
        for (name, _, _) in cases() {
            let rendered = std::fs::read_to_string(dir.join(name)).unwrap();
            let args = agent(&daemonset(&rendered)).args.unwrap();
            assert_eq!(args[0], "agent", "{name}: the subcommand");
            for arg in &args[1..] {
                let flag = arg
                    .strip_prefix("--")
                    .unwrap_or_else(|| panic!("{name}: {arg}"));
                let (flag, value) = flag.split_once('=').unwrap_or((flag, ""));
                let field = flag.replace('-', "_");
                let line = agent_args
                    .lines()
                    .map(str::trim)
                    .find(|l| l.starts_with(&format!("{field}: ")))
                    .unwrap_or_else(|| panic!("{name}: {arg} is not a flag of `ferry agent`"));
                // Booleans given a value take it (ArgAction::Set); plain switches none.
                if line.ends_with("bool,") && !value.is_empty() {
                    assert!(["true", "false"].contains(&value), "{name}: {arg}");
                    let field_at = agent_args.find(&format!("    {field}: ")).unwrap();
                    let attrs = &agent_args[..field_at];
                    let attr = &attrs[attrs.rfind("#[arg(").unwrap()..];
                    assert!(
                        attr.contains("ArgAction::Set"),
                        "{name}: {arg} takes no value"
                    );
                }
                if flag == "overlay" {
                    assert!(["none", "vxlan"].contains(&value), "{name}: {arg}");
                }
                checked += 1;
            }
        }
        assert!(checked > 20, "{checked} flags checked");
    }

    fn daemonset(rendered: &str) -> DaemonSet {
        let ds = serde_yaml::Deserializer::from_str(rendered)
            .map(|d| Value::deserialize(d).unwrap())
            .find(|v| v["kind"] == "DaemonSet")
            .unwrap();
        serde_json::from_value(ds).unwrap()
    }

    fn agent(ds: &DaemonSet) -> Container {
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        pod.containers
            .iter()
            .find(|c| c.name == CONTAINER)
            .unwrap()
            .clone()
    }

    #[test]
    fn only_the_patched_fields_differ_from_the_template() {
        let (_, decision, config) = cases().remove(0);
        let rendered = render(&decision, &config, "registry.example.com/ferry:1").unwrap();
        let template: Vec<Value> = serde_yaml::Deserializer::from_str(TEMPLATE)
            .map(|d| Value::deserialize(d).unwrap())
            .collect();
        let out: Vec<Value> = serde_yaml::Deserializer::from_str(&rendered)
            .map(|d| Value::deserialize(d).unwrap())
            .collect();
        assert_eq!(out.len(), template.len());
        // RBAC unchanged.
        assert_eq!(out[..3], template[..3]);
        // The DaemonSet: undo the patch and the template comes back.
        let mut ds = out[3].clone();
        let c = &mut ds["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["image"], "registry.example.com/ferry:1");
        c["image"] = template[3]["spec"]["template"]["spec"]["containers"][0]["image"].clone();
        let args = c["args"].as_array_mut().unwrap();
        args.truncate(args.len() - 3);
        c["env"][1]["value"] = "API_SERVER_HOST".into();
        c["env"][2]["value"] = "API_SERVER_PORT".into();
        c["volumeMounts"].as_array_mut().unwrap().truncate(4);
        ds["spec"]["template"]["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .truncate(4);
        let template_ds: Value =
            serde_json::to_value(serde_json::from_value::<DaemonSet>(template[3].clone()).unwrap())
                .unwrap();
        assert_eq!(ds, template_ds);
    }

    #[test]
    fn kube_proxy_kept_no_takeover_no_service_routing_no_api_env() {
        let (_, decision, config) = cases().remove(2);
        let c = agent(&daemonset(&render(&decision, &config, "x").unwrap()));
        let args = c.args.unwrap();
        assert!(
            !args.iter().any(|a| a == "--takeover-kube-proxy"),
            "{args:?}"
        );
        assert!(
            args.iter().any(|a| a == "--service-routing=false"),
            "{args:?}"
        );
        let env: Vec<_> = c.env.unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(env, ["NODE_NAME", "RUST_LOG"]);
    }

    #[test]
    fn kube_proxy_disabled_takes_over_and_points_at_the_api_server() {
        let (_, decision, config) = cases().remove(1);
        let c = agent(&daemonset(&render(&decision, &config, "x").unwrap()));
        let args = c.args.unwrap();
        assert!(
            args.iter().any(|a| a == "--takeover-kube-proxy"),
            "{args:?}"
        );
        assert!(
            !args.iter().any(|a| a.starts_with("--service-routing")),
            "{args:?}"
        );
        for want in [
            "--overlay=vxlan",
            "--masquerade=false",
            "--mtu=1450",
            "--max-services=100000",
            "--max-backends=200000",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing in {args:?}");
        }
        let env: Vec<_> = c
            .env
            .unwrap()
            .into_iter()
            .filter(|e| e.name.starts_with("KUBERNETES_SERVICE_"))
            .map(|e| (e.name, e.value.unwrap()))
            .collect();
        assert_eq!(
            env,
            [
                (
                    "KUBERNETES_SERVICE_HOST".to_string(),
                    "api.bar.foo.example.com".to_string()
                ),
                ("KUBERNETES_SERVICE_PORT".to_string(), "8443".to_string())
            ]
        );
    }

    #[test]
    fn the_template_names_the_default_image() {
        let ds = daemonset(TEMPLATE);
        assert_eq!(agent(&ds).image.as_deref(), Some(default_image().as_str()));
    }
}
