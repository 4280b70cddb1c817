//! The controller (`ferry_gardener::controller`) against the in-process fake API server
//! of `ferry-tests`, with the seed's objects as gardenlet writes them: a `Cluster`
//! carrying the shoot and a `Network` of type `ferry`. Each test starts its own server and
//! controller, acts as gardenlet (and, where a test needs it, as gardener-resource-manager)
//! and checks what the controller writes. Every wait polls with a deadline.

use std::time::{Duration, Instant};

use ferry_gardener::{
    config, controller, managed,
    operation::FINALIZER,
    status::ERR_CONFIGURATION_PROBLEM,
    types::{OPERATION_ANNOTATION, cluster_resource, managed_resource_resource, network_resource},
};
use ferry_tests::fakeapi::FakeApi;
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

const NS: &str = "shoot--foo--bar";
const NAME: &str = "bar";
const IMAGE: &str = "registry.example.com/ferry:test";
const WAIT: Duration = Duration::from_secs(10);
const EXTENSIONS: &str = "extensions.gardener.cloud/v1alpha1";
const RESOURCES: &str = "resources.gardener.cloud/v1alpha1";

/// A shoot as the Cluster carries it (core.gardener.cloud/v1beta1, defaulted).
fn shoot(kube_proxy: bool, families: &[&str]) -> Value {
    let pods = ["100.64.0.0/12", "fd00:10:64::/56"];
    let services = ["100.104.0.0/13", "fd00:10:104::/112"];
    json!({
        "apiVersion": "core.gardener.cloud/v1beta1",
        "kind": "Shoot",
        "metadata": {"name": NAME, "namespace": "garden-foo"},
        "spec": {
            "kubernetes": {"version": "1.33.2",
                           "kubeProxy": {"enabled": kube_proxy, "mode": "IPTables"}},
            "networking": {"type": "ferry", "pods": pods[0], "services": services[0],
                           "nodes": "10.250.0.0/16", "ipFamilies": families},
            "provider": {"type": "local", "workers": [{"name": "w"}]},
        },
        "status": {
            "networking": {"pods": &pods[..families.len()],
                           "services": &services[..families.len()],
                           "nodes": ["10.250.0.0/16"]},
            "advertisedAddresses": [
                {"name": "internal", "url": "https://api.bar.foo.internal.example.com"},
                {"name": "external", "url": "https://api.bar.foo.example.com"},
            ],
            "lastOperation": {"type": "Reconcile", "state": "Processing"},
        },
    })
}

fn cluster(shoot: Value) -> Value {
    json!({
        "apiVersion": EXTENSIONS,
        "kind": "Cluster",
        "metadata": {"name": NS},
        "spec": {"cloudProfile": {}, "seed": {}, "shoot": shoot},
    })
}

fn network(families: &[&str], provider_config: Option<Value>) -> Value {
    json!({
        "apiVersion": EXTENSIONS,
        "kind": "Network",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "annotations": {OPERATION_ANNOTATION: "reconcile",
                            "gardener.cloud/timestamp": "2026-01-02T03:04:05Z"},
        },
        "spec": {"type": "ferry", "podCIDR": "100.64.0.0/12", "serviceCIDR": "100.104.0.0/13",
                 "ipFamilies": families, "providerConfig": provider_config},
    })
}

/// A fake seed with the controller running against it.
struct Seed {
    api: FakeApi,
    client: Client,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Seed {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Seed {
    fn start() -> Seed {
        let api = FakeApi::start();
        let config = kube::Config::new(api.url().parse().expect("the fake's URL"));
        let client = Client::try_from(config).expect("a client for the fake API server");
        let ctx = controller::Context {
            client: client.clone(),
            ferry_image: IMAGE.to_string(),
        };
        let tasks = vec![tokio::spawn(controller::run(ctx))];
        Seed { api, client, tasks }
    }

    /// A Cluster and a Network created through the API, as gardenlet does.
    async fn create(&self, cluster: Value, network: Value) {
        let pp = PostParams::default();
        let clusters: Api<DynamicObject> = Api::all_with(self.client.clone(), &cluster_resource());
        clusters
            .create(&pp, &serde_json::from_value(cluster).unwrap())
            .await
            .expect("create the Cluster");
        self.networks()
            .create(&pp, &serde_json::from_value(network).unwrap())
            .await
            .expect("create the Network");
    }

    fn networks(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NS, &network_resource())
    }

    fn managed_resources(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NS, &managed_resource_resource())
    }

    fn network(&self) -> Option<Value> {
        self.api.get_object(EXTENSIONS, "networks", NS, NAME)
    }

    fn managed_resource(&self) -> Option<Value> {
        self.api.get_object(
            RESOURCES,
            "managedresources",
            NS,
            managed::MANAGED_RESOURCE_NAME,
        )
    }

    fn secrets(&self) -> Vec<Value> {
        self.api.list_objects("v1", "secrets", Some(NS))
    }

    /// Polls `f` until it gives `Some`, or fails the test after [`WAIT`] with the state.
    async fn wait<T>(&self, what: &str, f: impl Fn(&Seed) -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(t) = f(self) {
                return t;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the Network:\n{:#}\nthe ManagedResource:\n{:#}",
                self.network().unwrap_or_default(),
                self.managed_resource().unwrap_or_default(),
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the Network is done as gardenlet checks it (`CheckExtensionObject`):
    /// the operation annotation gone, `lastOperation` of `op` in `state`, and
    /// `observedGeneration` at the generation. Returns the Network.
    async fn wait_done(&self, op: &str, state: &str) -> Value {
        self.wait_done_and(op, state, "", |_| true).await
    }

    /// [`Seed::wait_done`], and `also` holds for the Network.
    async fn wait_done_and(
        &self,
        op: &str,
        state: &str,
        what: &str,
        also: impl Fn(&Value) -> bool,
    ) -> Value {
        self.wait(&format!("lastOperation {op}/{state} {what}"), |s| {
            let n = s.network()?;
            let last = &n["status"]["lastOperation"];
            (n["metadata"]["annotations"]
                .get(OPERATION_ANNOTATION)
                .is_none()
                && last["type"] == op
                && last["state"] == state
                && n["status"]["observedGeneration"] == n["metadata"]["generation"]
                && also(&n))
            .then_some(n)
        })
        .await
    }

    /// Sets the shoot's `kubeProxy.enabled`, requests a reconcile and waits until `op`
    /// succeeded with the Service routing that follows. Returns the Network.
    async fn switch_kube_proxy(&self, enabled: bool, op: &str) -> Value {
        self.patch_shoot(json!({"spec": {"kubernetes": {"kubeProxy": {"enabled": enabled}}}}))
            .await;
        self.request("reconcile").await;
        let routing = if enabled { "kube-proxy" } else { "ferry" };
        let what = format!("with Services routed by {routing}");
        self.wait_done_and(op, "Succeeded", &what, |n| {
            n["status"]["providerStatus"]["serviceRouting"] == routing
        })
        .await
    }

    /// Merge-patches the Network, as gardenlet does.
    async fn patch_network(&self, patch: Value) {
        self.networks()
            .patch(NAME, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("patch the Network");
    }

    /// Sets `gardener.cloud/operation` on the Network.
    async fn request(&self, operation: &str) {
        self.patch_network(json!({"metadata": {"annotations": {OPERATION_ANNOTATION: operation}}}))
            .await;
    }

    /// Merge-patches the shoot in the Cluster.
    async fn patch_shoot(&self, shoot: Value) {
        let clusters: Api<DynamicObject> = Api::all_with(self.client.clone(), &cluster_resource());
        clusters
            .patch(
                NS,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"shoot": shoot}})),
            )
            .await
            .expect("patch the Cluster");
    }

    /// The manifests of the Secret the ManagedResource references now.
    fn manifests(&self) -> Vec<Value> {
        let mr = self.managed_resource().expect("the ManagedResource");
        let name = mr["spec"]["secretRefs"][0]["name"]
            .as_str()
            .expect("a secretRef");
        let secret = self
            .api
            .get_object("v1", "secrets", NS, name)
            .unwrap_or_else(|| panic!("the Secret {name}"));
        let secret: Secret = serde_json::from_value(secret).unwrap();
        let data = &secret.data.expect("Secret data")[managed::DATA_KEY].0;
        ferry_tests::fakeapi::parse_yaml(std::str::from_utf8(data).unwrap()).unwrap()
    }

    /// The ferry container of the rendered DaemonSet.
    fn agent(&self) -> Value {
        let manifests = self.manifests();
        let ds = manifests
            .iter()
            .find(|m| m["kind"] == "DaemonSet")
            .expect("a DaemonSet");
        ds["spec"]["template"]["spec"]["containers"][0].clone()
    }
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn env(container: &Value, name: &str) -> Option<String> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| e["value"].as_str().unwrap_or_default().to_string())
}

fn has(args: &[String], arg: &str) -> bool {
    args.iter().any(|a| a == arg)
}

/// A Network that reconciled: the first operation is a Create (Gardener's
/// `ComputeOperationType`, no lastOperation yet).
async fn reconciled(families: &[&str], provider_config: Option<Value>) -> Seed {
    let seed = Seed::start();
    seed.create(
        cluster(shoot(false, families)),
        network(families, provider_config),
    )
    .await;
    seed.wait_done("Create", "Succeeded").await;
    seed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_renders_the_managed_resource_and_reports_success() {
    let started = Instant::now();
    let seed = Seed::start();
    seed.create(cluster(shoot(false, &["IPv4"])), network(&["IPv4"], None))
        .await;
    let n = seed.wait_done("Create", "Succeeded").await;
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(n["status"]["observedGeneration"], 1);
    assert_eq!(n["status"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(n["status"]["lastOperation"]["progress"], 100);
    assert!(n["status"].get("lastError").is_none(), "{n:#}");
    assert_eq!(
        n["status"]["providerStatus"],
        json!({"apiVersion": config::API_VERSION, "kind": "NetworkStatus",
               "serviceRouting": "ferry", "overlay": false})
    );
    // gardenlet's own timestamp annotation is left alone.
    assert_eq!(
        n["metadata"]["annotations"]["gardener.cloud/timestamp"],
        "2026-01-02T03:04:05Z"
    );

    let mr = seed.managed_resource().expect("the ManagedResource");
    assert_eq!(mr["metadata"]["labels"]["origin"], managed::ORIGIN);
    assert_eq!(mr["spec"]["keepObjects"], false);
    assert!(mr["spec"].get("class").is_none(), "{mr:#}");
    let secrets = seed.secrets();
    assert_eq!(secrets.len(), 1, "one Secret");
    assert_eq!(
        mr["spec"]["secretRefs"],
        json!([{"name": secrets[0]["metadata"]["name"]}])
    );
    assert_eq!(secrets[0]["immutable"], true);

    let manifests = seed.manifests();
    let kinds: Vec<&str> = manifests
        .iter()
        .map(|m| m["kind"].as_str().unwrap())
        .collect();
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
    ] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let agent = seed.agent();
    assert_eq!(agent["image"], IMAGE);
    let a = args(&agent);
    for arg in [
        "--takeover-kube-proxy",
        "--pod-network",
        "--cni-conf-dir=/host/etc/cni/net.d",
        "--cni-bin-dir=/host/opt/cni/bin",
    ] {
        assert!(has(&a, arg), "{arg} in {a:?}");
    }
    assert!(!has(&a, "--service-routing=false"), "{a:?}");
    assert_eq!(
        env(&agent, "KUBERNETES_SERVICE_HOST").as_deref(),
        Some("api.bar.foo.example.com")
    );
    assert_eq!(
        env(&agent, "KUBERNETES_SERVICE_PORT").as_deref(),
        Some("443")
    );

    // Its own status writes never start another operation: left alone, the Network
    // stays as it is.
    let rv = n["metadata"]["resourceVersion"].clone();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seed.network().unwrap()["metadata"]["resourceVersion"], rv);

    // The next request is a Reconcile; the same manifests give the same Secret.
    seed.request("reconcile").await;
    let n = seed.wait_done("Reconcile", "Succeeded").await;
    assert_eq!(n["status"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(seed.secrets().len(), 1);
    eprintln!("reconcile: {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_proxy_enabled_leaves_services_to_kube_proxy() {
    let seed = reconciled(&["IPv4"], None).await;
    seed.switch_kube_proxy(true, "Reconcile").await;
    let agent = seed.agent();
    let a = args(&agent);
    assert!(!has(&a, "--takeover-kube-proxy"), "{a:?}");
    assert!(has(&a, "--service-routing=false"), "{a:?}");
    assert!(has(&a, "--pod-network"), "{a:?}");
    // The agent still reaches the API server by its external address, which needs no
    // Service routing on the node.
    assert_eq!(
        env(&agent, "KUBERNETES_SERVICE_HOST").as_deref(),
        Some("api.bar.foo.example.com")
    );
    // A new Secret (content-addressed); the old one is left to GRM's garbage collector.
    assert_eq!(seed.secrets().len(), 2);

    // And back: ferry routes Services again.
    seed.switch_kube_proxy(false, "Reconcile").await;
    let a = args(&seed.agent());
    assert!(has(&a, "--takeover-kube-proxy"), "{a:?}");
    assert!(!has(&a, "--service-routing=false"), "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_families_follow_the_dual_stack_migration() {
    let seed = reconciled(&["IPv4"], None).await;
    let constraint = |status: &str| {
        json!({"status": {"constraints": [{
            "type": "DualStackNodesMigrationReady", "status": status,
            "reason": "NodesNotMigrated", "message": "nodes lack IPv6 pod CIDRs",
            "lastTransitionTime": "2026-01-02T03:04:05Z", "lastUpdateTime": "2026-01-02T03:04:05Z"}]}})
    };
    // gardenlet: the shoot moves to dual-stack, the nodes are not there yet.
    let mut s = shoot(false, &["IPv4", "IPv6"]);
    s["status"]["constraints"] = constraint("Progressing")["status"]["constraints"].clone();
    seed.patch_shoot(s).await;
    seed.patch_network(json!({
        "metadata": {"annotations": {OPERATION_ANNOTATION: "reconcile"}},
        "spec": {"ipFamilies": ["IPv4", "IPv6"]},
    }))
    .await;
    let n = seed.wait_done("Reconcile", "Succeeded").await;
    assert_eq!(n["metadata"]["generation"], 2);
    assert_eq!(
        n["status"]["ipFamilies"],
        json!(["IPv4"]),
        "single-stack while nodes migrate"
    );
    assert!(
        n["status"]["lastOperation"]["description"]
            .as_str()
            .unwrap()
            .contains("(IPv4)"),
        "{n:#}"
    );

    // Every node has both pod CIDRs: dual-stack is rendered and reported.
    seed.patch_shoot(constraint("True")).await;
    seed.request("reconcile").await;
    let n = seed
        .wait("ipFamilies [IPv4, IPv6]", |s| {
            s.network()
                .filter(|n| n["status"]["ipFamilies"] == json!(["IPv4", "IPv6"]))
        })
        .await;
    assert_eq!(n["status"]["lastOperation"]["state"], "Succeeded");

    // gardenlet completes the migration (drops the constraint); then back to IPv4.
    seed.patch_shoot(json!({"status": {"constraints": null},
                            "spec": {"networking": {"ipFamilies": ["IPv4"]}}}))
        .await;
    seed.patch_network(json!({
        "metadata": {"annotations": {OPERATION_ANNOTATION: "reconcile"}},
        "spec": {"ipFamilies": ["IPv4"]},
    }))
    .await;
    let n = seed.wait_done("Reconcile", "Succeeded").await;
    assert_eq!(n["metadata"]["generation"], 3);
    assert_eq!(n["status"]["ipFamilies"], json!(["IPv4"]));
}

/// A providerConfig that will never work fails with ERR_CONFIGURATION_PROBLEM and a
/// message naming the field, and leaves the ManagedResource as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_provider_config_fails_without_touching_the_managed_resource() {
    let good = json!({"apiVersion": config::API_VERSION, "kind": "NetworkConfig"});
    let seed = reconciled(&["IPv4"], Some(good.clone())).await;
    let mr = seed.managed_resource().unwrap();
    let cases = [
        (json!({"bogus": true}), "bogus"),
        (
            json!({"mtu": 70000}),
            "providerConfig.mtu: 70000 is out of range 1280..=9000",
        ),
        (json!({"kind": "Other"}), "providerConfig.kind"),
    ];
    let mut previous = json!({});
    for (change, expect) in cases {
        // gardenlet writes the whole providerConfig; as a merge patch, the previous
        // case's fields are removed explicitly.
        let mut bad = good.clone();
        for key in previous.as_object().unwrap().keys() {
            bad[key] = Value::Null;
        }
        bad.as_object_mut()
            .unwrap()
            .extend(change.as_object().unwrap().clone());
        previous = change;
        seed.patch_network(json!({
            "metadata": {"annotations": {OPERATION_ANNOTATION: "reconcile"}},
            "spec": {"providerConfig": bad},
        }))
        .await;
        let n = seed.wait_done("Reconcile", "Failed").await;
        let last_error = &n["status"]["lastError"];
        assert_eq!(
            last_error["codes"],
            json!([ERR_CONFIGURATION_PROBLEM]),
            "{n:#}"
        );
        let message = last_error["description"].as_str().unwrap();
        assert!(message.contains(expect), "{expect:?} in {message:?}");
        assert!(
            n["status"]["lastOperation"]["description"]
                .as_str()
                .unwrap()
                .contains(expect)
        );
        assert_eq!(
            seed.managed_resource().unwrap(),
            mr,
            "the ManagedResource is unchanged"
        );
        assert_eq!(seed.secrets().len(), 1);
        // Not retried: nothing is written until something changes.
        let rv = n["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(seed.network().unwrap()["metadata"]["resourceVersion"], rv);
    }
    // Fixed: Succeeded again, lastError gone.
    seed.patch_network(json!({
        "metadata": {"annotations": {OPERATION_ANNOTATION: "reconcile"}},
        "spec": {"providerConfig": good},
    }))
    .await;
    let n = seed.wait_done("Reconcile", "Succeeded").await;
    assert!(n["status"].get("lastError").is_none(), "{n:#}");
}

/// A new Network with `provider_config` that must fail: `Create`/`Failed` with
/// ERR_CONFIGURATION_PROBLEM and no ManagedResource. Returns the error's message.
async fn create_fails(provider_config: Value) -> (Seed, String) {
    let seed = Seed::start();
    seed.create(
        cluster(shoot(false, &["IPv4"])),
        network(&["IPv4"], Some(provider_config)),
    )
    .await;
    let n = seed.wait_done("Create", "Failed").await;
    let last_error = &n["status"]["lastError"];
    assert_eq!(last_error["codes"], json!([ERR_CONFIGURATION_PROBLEM]));
    assert!(seed.managed_resource().is_none());
    assert!(seed.secrets().is_empty());
    let message = last_error["description"].as_str().unwrap().to_string();
    (seed, message)
}

/// A new Network with a bad providerConfig gets no ManagedResource at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_provider_config_on_create() {
    let bad = json!({"apiVersion": config::API_VERSION, "kind": "NetworkConfig", "mtu": 100});
    let (_seed, message) = create_fails(bad).await;
    assert!(
        message.contains("providerConfig.mtu: 100 is out of range"),
        "{message}"
    );
}

/// kube-proxy disabled and ferry's Service routing off: nothing would route Services,
/// so the Network fails loudly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_service_routing_at_all_fails_loudly() {
    let off = json!({"apiVersion": config::API_VERSION, "kind": "NetworkConfig",
                     "serviceRouting": {"enabled": false}});
    let (seed, message) = create_fails(off).await;
    assert!(
        message.contains("kube-proxy is disabled") && message.contains("serviceRouting"),
        "{message}"
    );

    // With kube-proxy on, the same providerConfig is fine.
    seed.switch_kube_proxy(true, "Create").await;
}

/// Adds a finalizer to the ManagedResource, as gardener-resource-manager does, so a
/// deletion stays visible until the test lets it go.
async fn hold_managed_resource(seed: &Seed) {
    seed.managed_resources()
        .patch(
            managed::MANAGED_RESOURCE_NAME,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["resources.gardener.cloud/gardener-resource-manager"]}})),
        )
        .await
        .expect("add the ManagedResource's finalizer");
}

async fn release_managed_resource(seed: &Seed) {
    seed.managed_resources()
        .patch(
            managed::MANAGED_RESOURCE_NAME,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("drop the ManagedResource's finalizer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_the_managed_resource_then_the_finalizer() {
    let seed = reconciled(&["IPv4"], None).await;
    hold_managed_resource(&seed).await;
    // gardenlet: confirm, then delete.
    seed.patch_network(
        json!({"metadata": {"annotations": {"confirmation.gardener.cloud/deletion": "true"}}}),
    )
    .await;
    seed.networks()
        .delete(NAME, &DeleteParams::default())
        .await
        .expect("delete the Network");
    let mr = seed
        .wait("the ManagedResource being deleted", |s| {
            s.managed_resource()
                .filter(|mr| mr["metadata"].get("deletionTimestamp").is_some())
        })
        .await;
    assert_eq!(
        mr["spec"]["keepObjects"], false,
        "the shoot's objects go too"
    );
    assert!(seed.secrets().is_empty(), "the Secret is deleted first");
    // The Network waits for gardener-resource-manager.
    let n = seed
        .network()
        .expect("the Network stays while the MR exists");
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(n["status"]["lastOperation"]["type"], "Delete");
    assert_eq!(n["status"]["lastOperation"]["state"], "Processing");

    release_managed_resource(&seed).await;
    seed.wait("the Network gone", |s| s.network().is_none().then_some(()))
        .await;
    assert!(seed.managed_resource().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_keeps_the_shoot_objects_and_restore_reconciles() {
    let seed = reconciled(&["IPv4"], None).await;
    hold_managed_resource(&seed).await;
    seed.request("migrate").await;
    let mr = seed
        .wait("the ManagedResource deleted with keepObjects", |s| {
            s.managed_resource()
                .filter(|mr| mr["metadata"].get("deletionTimestamp").is_some())
        })
        .await;
    assert_eq!(mr["spec"]["keepObjects"], true, "{mr:#}");
    release_managed_resource(&seed).await;
    let n = seed.wait_done("Migrate", "Succeeded").await;
    assert!(
        n["metadata"].get("finalizers").is_none(),
        "all finalizers removed: {n:#}"
    );
    assert!(seed.managed_resource().is_none());
    assert!(seed.secrets().is_empty());

    // gardenlet in the new seed: wait-for-state (ignored), then restore.
    seed.request("wait-for-state").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        seed.managed_resource().is_none(),
        "wait-for-state does nothing"
    );
    seed.request("restore").await;
    let n = seed.wait_done("Restore", "Succeeded").await;
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(n["status"]["ipFamilies"], json!(["IPv4"]));
    let mr = seed.managed_resource().expect("the ManagedResource again");
    assert_eq!(mr["spec"]["keepObjects"], false);
    assert!(has(&args(&seed.agent()), "--takeover-kube-proxy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_lease_is_renewed() {
    let seed = Seed::start();
    let namespace = "extension-networking-ferry-x1";
    let period = Duration::from_millis(200);
    let task = tokio::spawn(controller::heartbeat(
        seed.client.clone(),
        namespace.to_string(),
        "networking-ferry".to_string(),
        period,
    ));
    let lease = |s: &Seed| {
        s.api.get_object(
            "coordination.k8s.io/v1",
            "leases",
            namespace,
            controller::HEARTBEAT_LEASE,
        )
    };
    let first = seed.wait("the heartbeat Lease", lease).await;
    assert_eq!(first["spec"]["holderIdentity"], "networking-ferry");
    assert_eq!(first["spec"]["leaseDurationSeconds"], 1);
    let renewed_at = |l: &Value| {
        l["spec"]["renewTime"]
            .as_str()
            .expect("renewTime")
            .parse::<k8s_openapi::jiff::Timestamp>()
            .expect("an RFC 3339 renewTime")
    };
    let t0 = renewed_at(&first);
    for _ in 0..2 {
        let before = renewed_at(&lease(&seed).unwrap());
        let later = seed
            .wait("the Lease renewed", |s| {
                lease(s).filter(|l| renewed_at(l) > before)
            })
            .await;
        assert_eq!(
            later["metadata"]["uid"], first["metadata"]["uid"],
            "the same Lease"
        );
    }
    assert!(renewed_at(&lease(&seed).unwrap()) > t0);
    task.abort();
}

/// A shoot whose last operation failed is not retried (Gardener's `IsFailed`): the
/// request is taken off and nothing else is written, until gardenlet retries the shoot.
/// A delete still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_shoot_is_skipped_but_can_be_deleted() {
    let seed = Seed::start();
    let mut failed = shoot(false, &["IPv4"]);
    failed["status"]["lastOperation"] = json!({"type": "Reconcile", "state": "Failed"});
    seed.create(cluster(failed), network(&["IPv4"], None)).await;
    let n = seed
        .wait("the reconcile annotation removed", |s| {
            s.network().filter(|n| {
                n["metadata"]["annotations"]
                    .get(OPERATION_ANNOTATION)
                    .is_none()
            })
        })
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = seed.network().unwrap();
    assert_eq!(
        now["metadata"]["resourceVersion"], n["metadata"]["resourceVersion"],
        "nothing written after the annotation: {now:#}"
    );
    assert!(now.get("status").is_none(), "{now:#}");
    assert!(now["metadata"].get("finalizers").is_none(), "{now:#}");
    assert!(seed.managed_resource().is_none());

    // gardenlet retries the shoot: Processing, then the reconcile request.
    seed.patch_shoot(json!({"status": {"lastOperation": {"state": "Processing"}}}))
        .await;
    seed.request("reconcile").await;
    seed.wait_done("Create", "Succeeded").await;
    assert!(seed.managed_resource().is_some());

    // Failed again, then deleted: the delete is not skipped.
    seed.patch_shoot(json!({"status": {"lastOperation": {"state": "Failed"}}}))
        .await;
    seed.request("reconcile").await;
    seed.wait("the request taken off", |s| {
        s.network().filter(|n| {
            n["metadata"]["annotations"]
                .get(OPERATION_ANNOTATION)
                .is_none()
        })
    })
    .await;
    seed.networks()
        .delete(NAME, &DeleteParams::default())
        .await
        .expect("delete the Network");
    seed.wait("the Network gone", |s| s.network().is_none().then_some(()))
        .await;
    assert!(seed.managed_resource().is_none());
}

/// The Network's `SystemComponentsHealthy` condition follows the ManagedResource's
/// conditions, as gardener-resource-manager writes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_condition_follows_the_managed_resource() {
    let mut seed = reconciled(&["IPv4"], None).await;
    seed.tasks.push(tokio::spawn(controller::health(
        seed.client.clone(),
        Duration::from_millis(100),
    )));
    let generation = seed.managed_resource().unwrap()["metadata"]["generation"].clone();
    let set = |healthy: &'static str, message: &'static str| {
        let mrs = seed.managed_resources();
        let generation = generation.clone();
        async move {
            let c = |type_: &str, status: &str, message: &str| {
                json!({"type": type_, "status": status, "reason": "R", "message": message,
                       "lastTransitionTime": "2026-01-02T03:04:05Z",
                       "lastUpdateTime": "2026-01-02T03:04:05Z"})
            };
            let status = json!({"status": {"observedGeneration": generation, "conditions": [
                c("ResourcesApplied", "True", "All resources are applied."),
                c("ResourcesHealthy", healthy, message),
                c("ResourcesProgressing", "False", "All resources are rolled out."),
            ]}});
            mrs.patch_status(
                managed::MANAGED_RESOURCE_NAME,
                &PatchParams::default(),
                &Patch::Merge(&status),
            )
            .await
            .expect("write the ManagedResource's status");
        }
    };
    let condition = |s: &Seed, status: &str| {
        let n = s.network()?;
        let c = n["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "SystemComponentsHealthy")?
            .clone();
        (c["status"] == status).then_some(c)
    };

    set("True", "All resources are healthy.").await;
    let healthy = seed
        .wait("SystemComponentsHealthy True", |s| condition(s, "True"))
        .await;
    assert_eq!(healthy["reason"], "HealthCheckSuccessful");
    assert_eq!(healthy["message"], "All health checks successful");
    for time in ["lastTransitionTime", "lastUpdateTime"] {
        assert!(healthy[time].is_string(), "{time}: {healthy:#}");
    }

    set(
        "False",
        "DaemonSet kube-system/ferry is unhealthy: 1 pod not ready",
    )
    .await;
    let sick = seed
        .wait("SystemComponentsHealthy False", |s| condition(s, "False"))
        .await;
    assert_eq!(sick["reason"], "HealthCheckUnsuccessful");
    let message = sick["message"].as_str().unwrap();
    assert!(
        message.contains("ResourcesHealthy")
            && message.contains("DaemonSet kube-system/ferry is unhealthy: 1 pod not ready"),
        "{message}"
    );
    // The rest of the status is the controller's and stays.
    let n = seed.network().unwrap();
    assert_eq!(n["status"]["lastOperation"]["state"], "Succeeded");

    set("True", "All resources are healthy.").await;
    let again = seed
        .wait("SystemComponentsHealthy True again", |s| {
            condition(s, "True")
        })
        .await;
    // Times are whole seconds (metav1.Time); the transition times never go back.
    let at = |c: &Value| c["lastTransitionTime"].as_str().unwrap().to_string();
    assert!(at(&healthy) <= at(&sick) && at(&sick) <= at(&again));
    // Unchanged, it is not written again: the Network keeps its resourceVersion.
    let rv = seed.network().unwrap()["metadata"]["resourceVersion"].clone();
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(seed.network().unwrap()["metadata"]["resourceVersion"], rv);
    // And a health write starts no operation.
    assert_eq!(
        seed.network().unwrap()["status"]["lastOperation"]["type"],
        "Create"
    );
}

/// Two replicas behind one leader Lease: only the leader reconciles; when it stops
/// without releasing (a crash), the other takes over within the lease duration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_reconciles_and_the_other_takes_over() {
    use ferry_gardener::leader;
    let api = FakeApi::start();
    let config = kube::Config::new(api.url().parse().expect("the fake's URL"));
    let client = Client::try_from(config).expect("a client for the fake API server");
    let namespace = "extension-networking-ferry-x1";
    let duration = Duration::from_secs(1);
    let replica = |identity: &str| {
        let config = leader::Config {
            namespace: namespace.to_string(),
            name: leader::LEASE_NAME.to_string(),
            identity: identity.to_string(),
            lease_duration: duration,
        };
        let ctx = controller::Context {
            client: client.clone(),
            ferry_image: format!("registry.example.com/ferry:{identity}"),
        };
        tokio::spawn(leader::lead(client.clone(), config, controller::run(ctx)))
    };
    let mut replicas = vec![replica("a"), replica("b")];
    let seed = Seed {
        api,
        client: client.clone(),
        tasks: vec![],
    };
    let lease = |s: &Seed| {
        s.api.get_object(
            "coordination.k8s.io/v1",
            "leases",
            namespace,
            leader::LEASE_NAME,
        )
    };
    let holder = |l: &Value| l["spec"]["holderIdentity"].as_str().unwrap().to_string();
    let first = holder(&seed.wait("a leader", lease).await);
    seed.create(cluster(shoot(false, &["IPv4"])), network(&["IPv4"], None))
        .await;
    seed.wait_done("Create", "Succeeded").await;
    let image = |s: &Seed| s.agent()["image"].as_str().unwrap().to_string();
    assert_eq!(image(&seed), format!("registry.example.com/ferry:{first}"));
    // Both replicas watch; only the leader writes: had the other reconciled, a second
    // Secret (its image) would be there.
    for _ in 0..3 {
        seed.request("reconcile").await;
        seed.wait_done("Reconcile", "Succeeded").await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seed.secrets().len(), 1, "one image, one Secret");
    let l = lease(&seed).unwrap();
    assert_eq!(holder(&l), first);
    assert_eq!(l["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(l["spec"]["leaseTransitions"], 0);

    // The leader crashes: it stops renewing and never releases.
    let (leader_index, other) = if first == "a" { (0, "b") } else { (1, "a") };
    replicas.remove(leader_index).abort();
    let stopped = Instant::now();
    let taken = seed
        .wait("the other replica leading", |s| {
            lease(s).filter(|l| holder(l) == other)
        })
        .await;
    let took = stopped.elapsed();
    assert!(
        took <= duration + Duration::from_millis(700),
        "took over after {took:?}"
    );
    assert_eq!(taken["spec"]["leaseTransitions"], 1);
    seed.request("reconcile").await;
    seed.wait("the new leader's image", |s| {
        (image(s) == format!("registry.example.com/ferry:{other}")).then_some(())
    })
    .await;
    seed.wait_done("Reconcile", "Succeeded").await;
    eprintln!("takeover after {took:?}");
    for r in replicas {
        r.abort();
    }
}
