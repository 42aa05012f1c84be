//! Everything a handler needs: `use inbox_core::prelude::*;`.

pub use crate::{
    CLAIM_TRANSACTION, Claim, Inbox, InboxError, InboxTransactionExt, MessageId, Outcome,
    ProcessError, RetryPolicy, Settlement, is_inbox_duplicate,
};
