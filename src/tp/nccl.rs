pub struct NcclId;
