//! placeholder: the Kubernetes API source (being written).
