//! Everything a handler needs: `use sea_orm_inbox::prelude::*;`.

pub use crate::{
    AdmissionFloor, BatchClaim, BatchOutcome, CLAIM_TRANSACTION, Claim, ClaimToken, ClaimedMessage,
    Delivery, Inbox, InboxError, InboxTable, InboxTransactionExt, Lease, LeaseClaim, LeaseOptions,
    MessageId, NackDelay, ObservedTransaction, Outcome, Permanent, ProcessError, Refusal,
    RetryPolicy, Settlement, Transient, claim_lease, claim_lease_with_token, is_inbox_duplicate,
};
