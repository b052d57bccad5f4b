use std::fmt;

/// The operations a `ke/meta/...` topic may carry (KubeEdge v1.3 MetaManager's set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Insert,
    Update,
    Delete,
    Query,
    Response,
    Error,
    Connect,
    MetaInternalSync,
    Action,
    ActionResult,
    CreateVolume,
    DeleteVolume,
    ControllerPublishVolume,
    ControllerUnpublishVolume,
}

impl Operation {
    /// Every operation, in the order the protocol lists them.
    pub const ALL: [Operation; 14] = [
        Operation::Insert,
        Operation::Update,
        Operation::Delete,
        Operation::Query,
        Operation::Response,
        Operation::Error,
        Operation::Connect,
        Operation::MetaInternalSync,
        Operation::Action,
        Operation::ActionResult,
        Operation::CreateVolume,
        Operation::DeleteVolume,
        Operation::ControllerPublishVolume,
        Operation::ControllerUnpublishVolume,
    ];

    /// The wire name, as used in topics and in the envelope's `route.operation`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Operation::Insert => "insert",
            Operation::Update => "update",
            Operation::Delete => "delete",
            Operation::Query => "query",
            Operation::Response => "response",
            Operation::Error => "error",
            Operation::Connect => "connect",
            Operation::MetaInternalSync => "meta-internal-sync",
            Operation::Action => "action",
            Operation::ActionResult => "action_result",
            Operation::CreateVolume => "createvolume",
            Operation::DeleteVolume => "deletevolume",
            Operation::ControllerPublishVolume => "controllerpublishvolume",
            Operation::ControllerUnpublishVolume => "controllerunpublishvolume",
        }
    }

    /// Parses a wire name; `None` for anything this node does not implement.
    pub fn parse(name: &str) -> Option<Operation> {
        Operation::ALL.into_iter().find(|op| op.as_str() == name)
    }

    /// Operations on one object, refused when nothing names it (protocol §2, v2). The others
    /// work on a type: `query` lists it; `connect`, `meta-internal-sync`, `response`, `error`
    /// and the volume calls keep the `<namespace>/<type>` resource.
    pub const fn needs_name(self) -> bool {
        matches!(
            self,
            Operation::Insert
                | Operation::Update
                | Operation::Delete
                | Operation::Action
                | Operation::ActionResult
        )
    }

    /// CSI volume operations are relayed to edged and answered synchronously (KubeEdge §3.10).
    pub const fn is_volume(self) -> bool {
        matches!(
            self,
            Operation::CreateVolume
                | Operation::DeleteVolume
                | Operation::ControllerPublishVolume
                | Operation::ControllerUnpublishVolume
        )
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Operation;

    #[test]
    fn every_wire_name_round_trips() {
        for op in Operation::ALL {
            assert_eq!(Operation::parse(op.as_str()), Some(op));
        }
    }

    #[test]
    fn only_operations_on_one_object_need_a_name() {
        let named: Vec<_> = Operation::ALL
            .into_iter()
            .filter(|op| op.needs_name())
            .map(Operation::as_str)
            .collect();
        assert_eq!(
            named,
            ["insert", "update", "delete", "action", "action_result"]
        );
    }

    #[test]
    fn unknown_and_differently_cased_names_are_rejected() {
        for name in ["", "Insert", "patch", "publish", "upsert", "insert "] {
            assert_eq!(Operation::parse(name), None, "{name:?}");
        }
    }
}
