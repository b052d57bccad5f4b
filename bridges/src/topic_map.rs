//! Topic rewriting between the node and the cloud broker (protocol §5):
//! `<root>/cloud/<rest>` goes up as `<cloud_root>/<node_id>/up/<rest>`;
//! `<cloud_root>/<node_id>/down/<rest>` comes in as `<root>/meta/<rest>`.
//! `<rest>` is `<from>/<op>/<namespace>/<type>[/<name>]`, passed through unchanged: up topics
//! have no name because the node's `<root>/cloud/...` topics have none (v2), down topics may.
//! Outbox rows a v1 node stored with a name level go up as they are.

/// The mapping for one node.
#[derive(Debug, Clone)]
pub struct TopicMap {
    local_cloud: String,
    local_meta: String,
    up: String,
    down: String,
    connection: String,
}

impl TopicMap {
    pub fn new(local_root: &str, cloud_root: &str, node_id: &str) -> TopicMap {
        TopicMap {
            local_cloud: format!("{local_root}/cloud/"),
            local_meta: format!("{local_root}/meta/"),
            up: format!("{cloud_root}/{node_id}/up/"),
            down: format!("{cloud_root}/{node_id}/down/"),
            connection: format!("{cloud_root}/{node_id}/connection"),
        }
    }

    /// The cloud filter this node subscribes to.
    pub fn down_filter(&self) -> String {
        format!("{}#", self.down)
    }

    /// The local filter whose traffic goes up.
    pub fn local_cloud_filter(&self) -> String {
        format!("{}#", self.local_cloud)
    }

    /// `<cloud_root>/<node_id>/connection`: the bridge's birth message (`cloud_connected`, on
    /// every connection) and Last Will (`cloud_disconnected`), retained, so the cloud's
    /// controller knows when to resync this node (protocol §5). Beside `up/`, not under it: it
    /// is session state, not outbox traffic.
    pub fn connection(&self) -> String {
        self.connection.clone()
    }

    /// Local cloud-bound topic → cloud topic; `None` if it is not cloud-bound.
    pub fn up(&self, local: &str) -> Option<String> {
        let rest = local
            .strip_prefix(&self.local_cloud)
            .filter(|r| !r.is_empty())?;
        Some(format!("{}{rest}", self.up))
    }

    /// Whether a local cloud-bound topic is a node heartbeat, sent live rather than through
    /// the outbox (`cloud/live.rs`).
    pub fn heartbeat(&self, local: &str) -> bool {
        let Some(rest) = local.strip_prefix(&self.local_cloud) else {
            return false;
        };
        let levels: Vec<&str> = rest.split('/').collect();
        matches!(
            levels.as_slice(),
            [_, "insert" | "update", _, "nodestatus" | "lease"]
        )
    }

    /// Cloud topic → local MetaManager topic; `None` if it is not this node's down traffic.
    pub fn down(&self, cloud: &str) -> Option<String> {
        let rest = cloud.strip_prefix(&self.down).filter(|r| !r.is_empty())?;
        Some(format!("{}{rest}", self.local_meta))
    }
}

#[cfg(test)]
mod tests {
    use super::TopicMap;

    fn map() -> TopicMap {
        TopicMap::new("ke", "kubeedge", "node-1")
    }

    #[test]
    fn the_connection_topic_sits_beside_up_and_down() {
        assert_eq!(map().connection(), "kubeedge/node-1/connection");
    }

    #[test]
    fn cloud_bound_topics_go_up_under_the_node() {
        assert_eq!(
            map().up("ke/cloud/meta/response/default/pod").as_deref(),
            Some("kubeedge/node-1/up/meta/response/default/pod")
        );
        // A row stored by a v1 node, with the name level, goes up as it is.
        assert_eq!(
            map()
                .up("ke/cloud/meta/response/default/pod/nginx")
                .as_deref(),
            Some("kubeedge/node-1/up/meta/response/default/pod/nginx")
        );
        assert_eq!(map().up("ke/edged/meta/response/default/pod/nginx"), None);
        assert_eq!(map().up("ke/cloud/"), None);
    }

    #[test]
    fn down_topics_become_metamanager_topics() {
        assert_eq!(
            map()
                .down("kubeedge/node-1/down/edgecontroller/insert/default/pod")
                .as_deref(),
            Some("ke/meta/edgecontroller/insert/default/pod")
        );
        assert_eq!(
            map()
                .down("kubeedge/node-1/down/edgecontroller/insert/default/pod/nginx")
                .as_deref(),
            Some("ke/meta/edgecontroller/insert/default/pod/nginx")
        );
        assert_eq!(
            map().down("kubeedge/node-2/down/edgecontroller/insert/default/pod/x"),
            None
        );
        assert_eq!(
            map().down("kubeedge/node-1/up/meta/response/default/pod/x"),
            None
        );
    }

    #[test]
    fn only_node_status_and_lease_writes_are_heartbeats() {
        assert!(map().heartbeat("ke/cloud/edged/update/default/nodestatus"));
        assert!(map().heartbeat("ke/cloud/edged/insert/default/nodestatus"));
        assert!(map().heartbeat("ke/cloud/edged/update/kube-node-lease/lease"));
        assert!(!map().heartbeat("ke/cloud/edged/update/default/podstatus"));
        assert!(!map().heartbeat("ke/cloud/edged/delete/default/nodestatus"));
        assert!(!map().heartbeat("ke/cloud/edged/update/default/nodestatus/n1"));
        assert!(!map().heartbeat("ke/meta/edged/update/default/nodestatus"));
    }

    #[test]
    fn filters_cover_the_node_only() {
        assert_eq!(map().down_filter(), "kubeedge/node-1/down/#");
        assert_eq!(map().local_cloud_filter(), "ke/cloud/#");
    }
}
