//! What the MetaManager's two end-to-end harnesses share: `metamanager/tests` drives the library
//! through channels, the node's `tests/` drive the binary over MQTT; both send a module's request
//! and follow where the node hands it on.

use serde_json::Value;

/// A test's view of the node's bus: it sends envelopes as a module and reads what modules get.
#[allow(async_fn_in_trait)] // test harnesses only, never `Send`-bound
pub trait ModuleBus {
    /// One received publication, as the harness keeps it.
    type Received;

    /// Sends `content` as module `from`'s `op` on `resource`; returns the envelope's `msg_id`.
    async fn send_as(&mut self, from: &str, op: &str, resource: &str, content: Value) -> String;

    /// The oldest publication about `resource` on a topic under `prefix`.
    async fn received(&mut self, prefix: &str, resource: &str) -> Self::Received;

    /// The `msg_id` of a received envelope.
    fn msg_id_of(received: &Self::Received) -> String;

    /// Sends a request and expects it handed on, with the same id, to module `to` on
    /// `ke/<to>/<from>/<op>/<ns>/<type>`, about `resource`; returns the request id and what `to`
    /// got.
    async fn handed_on(
        &mut self,
        from: &str,
        op: &str,
        resource: &str,
        content: Value,
        to: &str,
    ) -> (String, Self::Received) {
        let id = self.send_as(from, op, resource, content).await;
        let handed = self
            .received(&format!("ke/{to}/{from}/{op}"), resource)
            .await;
        assert_eq!(Self::msg_id_of(&handed), id, "handed to {to}");
        (id, handed)
    }
}
