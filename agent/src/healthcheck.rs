//! kube-proxy's healthCheckNodePort servers (contract KP-10): for a LoadBalancer Service with
//! externalTrafficPolicy Local, an HTTP server on `spec.healthCheckNodePort` tells cloud load
//! balancers whether this node has local endpoints.
//!
//! Matches kube-proxy's `pkg/proxy/healthcheck/service_health.go`: any method and path get
//! `200` when the Service has at least one local endpoint *and* the proxy is healthy, else `503`;
//! the body is the same tab-indented JSON; `X-Load-Balancing-Endpoint-Weight` carries the count
//! (also when it is 0). A port that cannot be bound is reported and retried on the next sync.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

/// One Service that needs a health check server, as the sync loop computes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheckService {
    pub namespace: String,
    pub name: String,
    pub port: u16,
    /// Ready endpoints on this node (terminating ones do not count: KP-10, K1669).
    pub local_endpoints: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum HealthCheckError {
    #[error("healthCheckNodePort {port} of Service {namespace}/{name}: cannot listen: {source}")]
    Listen {
        namespace: String,
        name: String,
        port: u16,
        source: io::Error,
    },
    #[error("healthCheckNodePort {port} of Service {namespace}/{name}: already served for {owner}")]
    PortShared {
        namespace: String,
        name: String,
        port: u16,
        owner: String,
    },
    #[error("Service {namespace}/{name}: healthCheckNodePort 0 cannot be served")]
    NoPort { namespace: String, name: String },
}

type ProxyHealthy = Arc<dyn Fn() -> bool + Send + Sync>;

/// One listening server. `target` is swapped in place, so counts change without a rebind.
struct Server {
    target: Arc<Mutex<HealthCheckService>>,
    task: JoinHandle<()>,
}

impl Server {
    /// Returns once the listening socket is closed: the aborted task has dropped it.
    async fn close(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Owns the healthCheckNodePort servers, keyed by port.
pub struct HealthChecks {
    /// kube-proxy's `ProxyHealthServer.Health().Healthy`: sync freshness only, not node
    /// eligibility (that is for `/healthz` alone).
    proxy_healthy: ProxyHealthy,
    servers: BTreeMap<u16, Server>,
}

impl HealthChecks {
    pub fn new(proxy_healthy: Arc<dyn Fn() -> bool + Send + Sync>) -> Self {
        Self {
            proxy_healthy,
            servers: BTreeMap::new(),
        }
    }

    /// One server per port; opens, updates and closes servers so that exactly `wanted` listen.
    /// Returns one error per port that could not be served (others unaffected), naming the Service and port.
    pub async fn sync(&mut self, mut wanted: Vec<HealthCheckService>) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        // Ports are unique cluster-wide (the apiserver allocates them), so a clash is a passing
        // inconsistency; sorting makes the winner the same on every sync.
        wanted.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut by_port = BTreeMap::new();
        for svc in wanted {
            if svc.port == 0 {
                errors.push(HealthCheckError::NoPort {
                    namespace: svc.namespace,
                    name: svc.name,
                });
                continue;
            }
            match by_port.entry(svc.port) {
                Entry::Vacant(e) => {
                    e.insert(svc);
                }
                Entry::Occupied(e) => errors.push(HealthCheckError::PortShared {
                    owner: format!("{}/{}", e.get().namespace, e.get().name),
                    namespace: svc.namespace,
                    name: svc.name,
                    port: svc.port,
                }),
            }
        }

        // Close first, so a port given up by one Service can be taken by another in this sync.
        let gone: Vec<u16> = self
            .servers
            .keys()
            .filter(|port| !by_port.contains_key(port))
            .copied()
            .collect();
        for port in gone {
            if let Some(server) = self.servers.remove(&port) {
                info!(port, "closing healthCheckNodePort");
                server.close().await;
            }
        }

        for (port, svc) in by_port {
            if let Some(server) = self.servers.get(&port) {
                *server.target.lock().expect("health check target lock") = svc;
                continue;
            }
            match listen(port) {
                Ok(listener) => {
                    info!(port, service = %format!("{}/{}", svc.namespace, svc.name), "opening healthCheckNodePort");
                    let target = Arc::new(Mutex::new(svc));
                    let task =
                        tokio::spawn(serve(listener, target.clone(), self.proxy_healthy.clone()));
                    self.servers.insert(port, Server { target, task });
                }
                // Not remembered: the next sync tries again (kube-proxy does the same).
                Err(source) => errors.push(HealthCheckError::Listen {
                    namespace: svc.namespace,
                    name: svc.name,
                    port,
                    source,
                }),
            }
        }
        errors.into_iter().map(anyhow::Error::from).collect()
    }
}

/// All addresses of both families: `[::]` dual-stack, or `0.0.0.0` where the network namespace
/// has no IPv6 at all.
fn listen(port: u16) -> io::Result<TcpListener> {
    match listen_on(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Err(e) if ipv6_unavailable(&e) => {
            listen_on(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        }
        other => other,
    }
}

/// Errors that mean "no IPv6 here" (module absent, `ipv6.disable=1`), not "port taken".
fn ipv6_unavailable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EPROTONOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

fn listen_on(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv6() {
        let socket = TcpSocket::new_v6()?;
        // Explicit, so `net.ipv6.bindv6only=1` cannot turn this into an IPv6-only server.
        set_v6only(&socket, false)?;
        socket
    } else {
        TcpSocket::new_v4()?
    };
    // As Go's listeners: a port just closed (connections in TIME_WAIT) can be reopened at once.
    // A port another socket is *listening* on still fails with EADDRINUSE.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

fn set_v6only(socket: &TcpSocket, only: bool) -> io::Result<()> {
    let value = libc::c_int::from(only);
    // SAFETY: a valid fd and a c_int option value of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

async fn serve(
    listener: TcpListener,
    target: Arc<Mutex<HealthCheckService>>,
    proxy_healthy: ProxyHealthy,
) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let (target, proxy_healthy) = (target.clone(), proxy_healthy.clone());
                tokio::spawn(async move {
                    if let Err(e) = respond(stream, &target, proxy_healthy.as_ref()).await {
                        debug!(error = %e, "health check connection");
                    }
                });
            }
            Err(e) => {
                // E.g. EMFILE: back off rather than spin on an error that persists.
                warn!(error = %e, "healthCheckNodePort accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Answers one request and closes the connection, like the agent's other HTTP endpoints.
async fn respond(
    mut stream: TcpStream,
    target: &Mutex<HealthCheckService>,
    proxy_healthy: &(dyn Fn() -> bool + Send + Sync),
) -> io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await??;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    let svc = target.lock().expect("health check target lock").clone();
    let healthy = proxy_healthy();
    let (code, reason) = if svc.local_endpoints > 0 && healthy {
        (200, "OK")
    } else {
        (503, "Service Unavailable")
    };
    let body = body(&svc, healthy);
    let mut response = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\n\
         X-Load-Balancing-Endpoint-Weight: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        svc.local_endpoints,
        body.len()
    );
    // HEAD gets the headers only, as Go's server does.
    if !head.starts_with(b"HEAD ") {
        response.push_str(&body);
    }
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// kube-proxy's body, byte for byte for Kubernetes names (tab-indented, no trailing newline).
fn body(svc: &HealthCheckService, proxy_healthy: bool) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        quote(&svc.namespace),
        quote(&svc.name),
        svc.local_endpoints
    )
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicBool, Ordering},
        time::Instant,
    };

    use super::*;

    fn svc(name: &str, local_endpoints: usize) -> HealthCheckService {
        HealthCheckService {
            namespace: "default".into(),
            name: name.into(),
            port: 0,
            local_endpoints,
        }
    }

    fn checks(healthy: &Arc<AtomicBool>) -> HealthChecks {
        let healthy = healthy.clone();
        HealthChecks::new(Arc::new(move || healthy.load(Ordering::SeqCst)))
    }

    /// A port nobody listens on right now (another process may take it: callers retry).
    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind port 0");
        l.local_addr().expect("local addr").port()
    }

    /// Gives each Service a free port and syncs, retrying with new ports when one was raced.
    async fn sync_on_free_ports(
        hc: &mut HealthChecks,
        mut wanted: Vec<HealthCheckService>,
    ) -> Vec<HealthCheckService> {
        for _ in 0..20 {
            for s in &mut wanted {
                s.port = free_port();
            }
            if hc.sync(wanted.clone()).await.is_empty() {
                return wanted;
            }
        }
        panic!("no free ports after 20 tries");
    }

    struct Reply {
        code: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            let found = self
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name));
            found.map(|(_, v)| v.as_str())
        }
        fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.body).expect("JSON body")
        }
    }

    async fn request(addr: SocketAddr, method: &str) -> io::Result<Reply> {
        let exchange = async {
            let mut s = TcpStream::connect(addr).await?;
            let req = format!("{method} /anything?x=1 HTTP/1.1\r\nHost: lb\r\n\r\n");
            s.write_all(req.as_bytes()).await?;
            let mut raw = String::new();
            s.read_to_string(&mut raw).await?;
            Ok::<_, io::Error>(raw)
        };
        let raw = tokio::time::timeout(Duration::from_secs(10), exchange).await??;
        let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP head");
        let mut lines = head.lines();
        let code = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok());
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Ok(Reply {
            code: code.expect("status code"),
            headers,
            body: body.to_string(),
        })
    }

    async fn get(port: u16) -> Reply {
        get_at(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
    }

    /// Polls until the server answers (bounded), so a slow runtime cannot fail the test.
    async fn get_at(addr: SocketAddr) -> Reply {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match request(addr, "GET").await {
                Ok(r) => return r,
                Err(e) if Instant::now() > deadline => panic!("GET {addr}: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// Closing is synchronous with `sync`, so the very first connect must be refused.
    async fn assert_refused(port: u16) {
        let err = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.err();
        assert_eq!(
            err.map(|e| e.kind()),
            Some(io::ErrorKind::ConnectionRefused),
            "port {port}"
        );
    }

    #[tokio::test]
    async fn healthcheck_counts_follow_sync() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let mut wanted = sync_on_free_ports(&mut hc, vec![svc("web", 2)]).await;
        let port = wanted[0].port;

        let r = get(port).await;
        assert_eq!(r.code, 200);
        assert_eq!(r.header("X-Load-Balancing-Endpoint-Weight"), Some("2"));
        assert_eq!(r.json()["localEndpoints"], 2);

        wanted[0].local_endpoints = 0;
        assert!(hc.sync(wanted.clone()).await.is_empty());
        let r = get(port).await;
        assert_eq!(r.code, 503);
        assert_eq!(r.header("X-Load-Balancing-Endpoint-Weight"), Some("0"));
        assert_eq!(r.json()["localEndpoints"], 0);

        // Another Service taking over the same port is reported under its own name.
        wanted[0].name = "api".into();
        wanted[0].local_endpoints = 1;
        assert!(hc.sync(wanted).await.is_empty());
        let r = get(port).await;
        assert_eq!(r.code, 200);
        assert_eq!(r.json()["service"]["name"], "api");
    }

    #[tokio::test]
    async fn healthcheck_body_and_headers_match_kube_proxy() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let mut wanted = vec![svc("web", 3)];
        wanted[0].namespace = "shop".into();
        let wanted = sync_on_free_ports(&mut hc, wanted).await;

        let r = get(wanted[0].port).await;
        assert_eq!(r.header("Content-Type"), Some("application/json"));
        assert_eq!(r.header("X-Content-Type-Options"), Some("nosniff"));
        assert_eq!(
            r.json(),
            serde_json::json!({
                "service": {"namespace": "shop", "name": "web"},
                "localEndpoints": 3,
                "serviceProxyHealthy": true
            })
        );
        assert_eq!(
            r.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
        );
        assert_eq!(
            r.header("Content-Length"),
            Some(r.body.len().to_string().as_str())
        );

        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, wanted[0].port));
        let head = request(addr, "HEAD").await.expect("HEAD");
        assert_eq!((head.code, head.body.as_str()), (200, ""));
    }

    #[tokio::test]
    async fn healthcheck_unhealthy_proxy_answers_503_with_endpoints() {
        let healthy = Arc::new(AtomicBool::new(false));
        let mut hc = checks(&healthy);
        let wanted = sync_on_free_ports(&mut hc, vec![svc("web", 2)]).await;

        let r = get(wanted[0].port).await;
        assert_eq!(r.code, 503);
        assert_eq!(r.json()["serviceProxyHealthy"], false);
        assert_eq!(r.json()["localEndpoints"], 2);
        assert_eq!(r.header("X-Load-Balancing-Endpoint-Weight"), Some("2"));

        // Read per request: recovery needs no sync.
        healthy.store(true, Ordering::SeqCst);
        let r = get(wanted[0].port).await;
        assert_eq!(r.code, 200);
        assert_eq!(r.json()["serviceProxyHealthy"], true);
    }

    #[tokio::test]
    async fn healthcheck_removed_service_closes_listener_at_once() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let wanted = sync_on_free_ports(&mut hc, vec![svc("web", 1), svc("db", 1)]).await;
        assert_eq!(get(wanted[0].port).await.code, 200);

        // "web" turned ClusterIP / Cluster policy / was deleted: only "db" is still wanted.
        assert!(hc.sync(vec![wanted[1].clone()]).await.is_empty());
        assert_refused(wanted[0].port).await;
        assert_eq!(get(wanted[1].port).await.code, 200);

        assert!(hc.sync(Vec::new()).await.is_empty());
        assert_refused(wanted[1].port).await;
    }

    #[tokio::test]
    async fn healthcheck_port_change_moves_listener() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let first = sync_on_free_ports(&mut hc, vec![svc("web", 1)]).await;
        let moved = sync_on_free_ports(&mut hc, first.clone()).await;
        assert_ne!(first[0].port, moved[0].port);
        assert_refused(first[0].port).await;
        assert_eq!(get(moved[0].port).await.code, 200);
    }

    #[tokio::test]
    async fn healthcheck_port_in_use_fails_alone_and_is_retried() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let mut wanted = sync_on_free_ports(&mut hc, vec![svc("web", 1), svc("db", 1)]).await;

        // Someone else listens on the port "db" moves to.
        let blocker = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind");
        wanted[1].port = blocker.local_addr().expect("addr").port();
        let errors = hc.sync(wanted.clone()).await;
        assert_eq!(errors.len(), 1, "{errors:?}");
        let message = errors[0].to_string();
        assert!(message.contains("default/db"), "{message}");
        assert!(message.contains(&wanted[1].port.to_string()), "{message}");
        assert_eq!(get(wanted[0].port).await.code, 200);

        // Freed: the next sync serves it, and "web" was never disturbed.
        drop(blocker);
        assert!(hc.sync(wanted.clone()).await.is_empty());
        assert_eq!(get(wanted[1].port).await.code, 200);
        assert_eq!(get(wanted[0].port).await.code, 200);
    }

    #[tokio::test]
    async fn healthcheck_duplicate_or_zero_port_is_an_error_for_that_service() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let wanted = sync_on_free_ports(&mut hc, vec![svc("a", 1)]).await;
        let mut clash = svc("b", 0);
        clash.port = wanted[0].port;
        let errors = hc.sync(vec![wanted[0].clone(), clash, svc("c", 1)]).await;
        let messages: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            messages
                .iter()
                .any(|m| m.contains("default/b") && m.contains("default/a"))
        );
        assert!(messages.iter().any(|m| m.contains("default/c")));
        // Sorted by name, "a" keeps the port.
        assert_eq!(get(wanted[0].port).await.json()["service"]["name"], "a");
    }

    #[tokio::test]
    async fn healthcheck_serves_both_families() {
        let healthy = Arc::new(AtomicBool::new(true));
        let mut hc = checks(&healthy);
        let wanted = sync_on_free_ports(&mut hc, vec![svc("web", 1)]).await;
        assert_eq!(get(wanted[0].port).await.code, 200);
        // Only where this network namespace has IPv6 loopback.
        if std::net::TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).is_ok() {
            let r = get_at(SocketAddr::from((Ipv6Addr::LOCALHOST, wanted[0].port))).await;
            assert_eq!(r.code, 200);
        }
    }

    #[test]
    fn healthcheck_ipv6_fallback_only_for_missing_ipv6() {
        assert!(ipv6_unavailable(&io::Error::from_raw_os_error(
            libc::EAFNOSUPPORT
        )));
        assert!(ipv6_unavailable(&io::Error::from_raw_os_error(
            libc::EADDRNOTAVAIL
        )));
        assert!(!ipv6_unavailable(&io::Error::from_raw_os_error(
            libc::EADDRINUSE
        )));
        assert!(!ipv6_unavailable(&io::Error::from_raw_os_error(
            libc::EACCES
        )));
    }
}
