//! Queries (§2.3, §2.4): answered from the store, or cache-first from the cloud while it is
//! connected; the cloud's answer is matched in [`super::answer`].

use crate::error::Error;
use crate::request::{Request, Requester};
use crate::routing;
use crate::store::Db;
use crate::unit::{Context, PendingKind};
use edgemeta_protocol::new_msg_id;
use edgemeta_protocol::Operation;
use edgemeta_protocol::Resource;
use edgemeta_protocol::CLOUD;

/// §2.3: local answer, or a cache-first remote query while the cloud is connected.
pub(crate) async fn apply(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let res_type = request.resource.res_type();
    if cx.connected() && routing::REMOTE_QUERY_TYPES.contains(&res_type) {
        let cached = if routing::ALWAYS_REMOTE_TYPES.contains(&res_type) {
            None
        } else {
            cx.db()
                .get(request.resource.key())
                .await
                .map_err(Error::store("query meta"))?
        };
        return match cached {
            Some(value) => answer_values(&request.requester, vec![value], cx).await,
            None => remote_query(request, cx).await,
        };
    }
    local_answer(request, cx).await
}

pub(crate) async fn local_values(db: &Db, resource: &Resource) -> Result<Vec<String>, Error> {
    let values = match resource.id() {
        None => db.list_by_type(resource.res_type()).await,
        Some(_) => db
            .get(resource.key())
            .await
            .map(|v| v.into_iter().collect()),
    };
    values.map_err(Error::store("query meta"))
}

pub(crate) async fn local_answer(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let values = local_values(cx.db(), &request.resource).await?;
    answer_values(&request.requester, values, cx).await
}

/// Answers with KubeEdge's `[]string`: each stored document as a JSON string.
pub(crate) async fn answer_values(
    requester: &Requester,
    values: Vec<String>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let content = || serde_json::value::to_raw_value(&values).expect("strings serialize");
    cx.reply(requester, Operation::Response, content).await
}

/// §2.4: the query goes to the cloud under a fresh id; the answer is matched by that id.
async fn remote_query(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let mut envelope = request.envelope.clone();
    envelope.header.msg_id = new_msg_id();
    cx.send(CLOUD, &request.requester.from, &envelope).await?;
    let timeout = cx.waits().remote_query;
    cx.wait_for(
        envelope.header.msg_id,
        PendingKind::RemoteQuery,
        request,
        timeout,
    );
    Ok(())
}
