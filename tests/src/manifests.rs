//! Builders for the Service and EndpointSlice YAML that tests write.

use std::fmt::Write as _;

/// A Service port: (name, port, protocol).
pub type Port<'a> = (&'a str, u16, &'a str);

#[derive(Clone, Debug)]
pub struct Ep {
    pub ip: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<String>,
}

/// A ready endpoint.
pub fn ep(ip: impl ToString) -> Ep {
    Ep {
        ip: ip.to_string(),
        ready: true,
        serving: true,
        terminating: false,
        node: None,
    }
}

impl Ep {
    pub fn on(mut self, node: &str) -> Ep {
        self.node = Some(node.into());
        self
    }
    pub fn terminating(mut self, serving: bool) -> Ep {
        self.ready = false;
        self.serving = serving;
        self.terminating = true;
        self
    }
}

/// A ClusterIP Service. `extra_spec` is indented YAML added under `spec:` (e.g.
/// `"  sessionAffinity: ClientIP\n"`); ports are (name, port, protocol).
pub fn service(name: &str, cluster_ips: &[&str], ports: &[Port<'_>], extra_spec: &str) -> String {
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  clusterIP: {}\n  clusterIPs: [{}]\n",
        cluster_ips[0],
        cluster_ips.join(", ")
    );
    s.push_str("  ports:\n");
    for (pname, port, proto) in ports {
        let _ = writeln!(
            s,
            "  - name: \"{pname}\"\n    port: {port}\n    protocol: {proto}"
        );
    }
    s.push_str(extra_spec);
    s
}

/// An EndpointSlice of `svc`; ports are (name, targetPort, protocol).
pub fn slice(svc: &str, slice_name: &str, family: &str, ports: &[Port<'_>], eps: &[Ep]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {slice_name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: {family}\nports:\n"
    );
    for (pname, port, proto) in ports {
        let _ = writeln!(
            s,
            "- name: \"{pname}\"\n  port: {port}\n  protocol: {proto}"
        );
    }
    s.push_str("endpoints:\n");
    for e in eps {
        let _ = writeln!(
            s,
            "- addresses: [\"{}\"]\n  conditions: {{ready: {}, serving: {}, terminating: {}}}",
            e.ip, e.ready, e.serving, e.terminating
        );
        if let Some(n) = &e.node {
            let _ = writeln!(s, "  nodeName: {n}");
        }
    }
    if eps.is_empty() {
        s = s.replace("endpoints:\n", "endpoints: []\n");
    }
    s
}

/// Joins documents into one multi-document YAML file.
pub fn docs(parts: &[String]) -> String {
    parts.join("---\n")
}

/// Adds metadata labels to a document built by [`service`] (which has none of its own).
pub fn with_labels(doc: &str, labels: &[(&str, &str)]) -> String {
    let mut block = String::from("  namespace: default\n  labels:\n");
    for (k, v) in labels {
        let _ = writeln!(block, "    {k}: \"{v}\"");
    }
    doc.replacen("  namespace: default\n", &block, 1)
}

/// Adds lines under the port entry `port` of a document built by [`service`]
/// (e.g. `"    nodePort: 30080\n    targetPort: http\n"`).
pub fn with_port_fields(doc: &str, port: u16, fields: &str) -> String {
    let needle = format!("    port: {port}\n");
    assert!(doc.contains(&needle), "no port {port} in {doc}");
    doc.replacen(&needle, &format!("{needle}{fields}"), 1)
}

/// A Service port with a nodePort: (name, port, protocol, nodePort).
pub type NodePortSpec<'a> = (&'a str, u16, &'a str, u16);

/// A NodePort or LoadBalancer Service (`svc_type`): every port gets its nodePort;
/// `extra_spec` is indented YAML under `spec:` (e.g. `"  externalTrafficPolicy: Local\n"`)
/// and `status` a top-level `status:` block (see [`lb_status`]) or "".
pub fn external_service(
    name: &str,
    svc_type: &str,
    cluster_ips: &[&str],
    ports: &[NodePortSpec<'_>],
    extra_spec: &str,
    status: &str,
) -> String {
    let plain: Vec<Port<'_>> = ports.iter().map(|(n, p, pr, _)| (*n, *p, *pr)).collect();
    let mut s = service(
        name,
        cluster_ips,
        &plain,
        &format!("  type: {svc_type}\n{extra_spec}"),
    );
    // Port entries appear in order: insert each nodePort after its protocol line.
    let mut at = s.find("  ports:\n").expect("ports");
    for (_, _, proto, node_port) in ports {
        let entry = format!("    protocol: {proto}\n");
        at += s[at..].find(&entry).expect("port entry") + entry.len();
        let line = format!("    nodePort: {node_port}\n");
        s.insert_str(at, &line);
        at += line.len();
    }
    s.push_str(status);
    s
}

/// `status.loadBalancer.ingress` with (ip, ipMode); an empty ipMode leaves the field out.
pub fn lb_status(ingress: &[(&str, &str)]) -> String {
    let mut s = String::from("status:\n  loadBalancer:\n    ingress:\n");
    for (ip, mode) in ingress {
        let _ = writeln!(s, "    - ip: {ip}");
        if !mode.is_empty() {
            let _ = writeln!(s, "      ipMode: {mode}");
        }
    }
    s
}
