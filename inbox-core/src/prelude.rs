//! Everything a handler needs: `use sea_orm_inbox::prelude::*;`.

pub use crate::{
    BatchClaim, CLAIM_TRANSACTION, Claim, ClaimToken, ClaimedMessage, Inbox, InboxError,
    InboxTransactionExt, Lease, LeaseClaim, LeaseOptions, MessageId, Outcome, ProcessError,
    RetryPolicy, Settlement, claim_lease, claim_lease_with_token, complete_lease,
    is_inbox_duplicate, release_lease,
};
