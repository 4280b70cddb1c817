//! The seed objects that carry the rendered manifests into the shoot: an immutable Secret
//! holding them, and the `ManagedResource` (`resources.gardener.cloud/v1alpha1`) that the
//! shoot's gardener-resource-manager applies, in the shape Gardener's own helper gives them
//! (`pkg/utils/managedresources`): content-addressed Secret name, garbage-collectable
//! label, reference annotation, `origin` label, `shoot.gardener.cloud/no-cleanup`.

use std::collections::BTreeMap;

use k8s_openapi::{
    ByteString, api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The ManagedResource's name in the shoot's control-plane namespace.
pub const MANAGED_RESOURCE_NAME: &str = "extension-networking-ferry-config";
/// Its `origin` label: this extension, not Gardener.
pub const ORIGIN: &str = "extension-networking-ferry";
/// The Secret key holding the manifests.
pub const DATA_KEY: &str = "config.yaml";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The Secret holding `manifests`, named after its content, so a change is a new Secret
/// and the old one is left to gardener-resource-manager's garbage collector.
pub fn secret(namespace: &str, manifests: &str) -> Secret {
    let name = format!(
        "managedresource-{MANAGED_RESOURCE_NAME}-{}",
        &sha256_hex(manifests.as_bytes())[..8]
    );
    Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                "resources.gardener.cloud/garbage-collectable-reference".to_string(),
                "true".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_string()),
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            DATA_KEY.to_string(),
            ByteString(manifests.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

/// The annotation that tells gardener-resource-manager's garbage collector the Secret is
/// still referenced.
fn reference_annotation(secret_name: &str) -> String {
    format!(
        "reference.resources.gardener.cloud/secret-{}",
        &sha256_hex(secret_name.as_bytes())[..8]
    )
}

/// The ManagedResource referencing `secret_name`, as a full object for server-side apply.
/// `keep_objects` is true only for migration: the shoot keeps what was applied.
pub fn managed_resource(namespace: &str, secret_name: &str, keep_objects: bool) -> Value {
    json!({
        "apiVersion": "resources.gardener.cloud/v1alpha1",
        "kind": "ManagedResource",
        "metadata": {
            "name": MANAGED_RESOURCE_NAME,
            "namespace": namespace,
            "labels": {"origin": ORIGIN},
            "annotations": {reference_annotation(secret_name): secret_name},
        },
        "spec": {
            "secretRefs": [{"name": secret_name}],
            "keepObjects": keep_objects,
            "injectLabels": {"shoot.gardener.cloud/no-cleanup": "true"},
        }
    })
}

/// The names of the Secrets a ManagedResource object references.
pub fn secret_refs(managed_resource: &Value) -> Vec<String> {
    managed_resource["spec"]["secretRefs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_is_immutable_content_addressed_and_collectable() {
        let a = secret("shoot--foo--bar", "kind: A\n");
        let b = secret("shoot--foo--bar", "kind: B\n");
        let name = a.metadata.name.clone().unwrap();
        assert!(
            name.starts_with("managedresource-extension-networking-ferry-config-"),
            "{name}"
        );
        assert_eq!(
            name.len(),
            "managedresource-extension-networking-ferry-config-".len() + 8
        );
        assert_ne!(a.metadata.name, b.metadata.name);
        assert_eq!(a.metadata.name, secret("other", "kind: A\n").metadata.name);
        assert_eq!(a.immutable, Some(true));
        assert_eq!(a.type_.as_deref(), Some("Opaque"));
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(
            v["metadata"]["labels"]["resources.gardener.cloud/garbage-collectable-reference"],
            "true"
        );
        assert_eq!(v["metadata"]["namespace"], "shoot--foo--bar");
        // Secret data travels base64-encoded.
        assert_eq!(v["data"]["config.yaml"], "a2luZDogQQo=");
    }

    #[test]
    fn managed_resource_references_the_secret() {
        let mr = managed_resource("shoot--foo--bar", "managedresource-x-12345678", false);
        assert_eq!(mr["metadata"]["name"], MANAGED_RESOURCE_NAME);
        assert_eq!(mr["metadata"]["labels"]["origin"], ORIGIN);
        assert_eq!(mr["spec"]["keepObjects"], false);
        assert_eq!(
            mr["spec"]["injectLabels"]["shoot.gardener.cloud/no-cleanup"],
            "true"
        );
        assert_eq!(secret_refs(&mr), ["managedresource-x-12345678"]);
        let annotations = mr["metadata"]["annotations"].as_object().unwrap();
        assert_eq!(annotations.len(), 1);
        let (key, value) = annotations.iter().next().unwrap();
        // sha256("managedresource-x-12345678")[..8]
        assert_eq!(
            key,
            &format!(
                "reference.resources.gardener.cloud/secret-{}",
                &sha256_hex(b"managedresource-x-12345678")[..8]
            )
        );
        assert_eq!(
            key.len(),
            "reference.resources.gardener.cloud/secret-".len() + 8
        );
        assert_eq!(value, "managedresource-x-12345678");
        assert!(
            managed_resource("ns", "s", true)["spec"]["keepObjects"]
                .as_bool()
                .unwrap()
        );
    }

    #[test]
    fn sha256_matches_a_known_digest() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
