"""What makes the transformer blocks fast, applied to the regional blocks the build finds: regional `torch.compile`
through accelerate's TorchDynamoPlugin (compiling) and Float8 linear layers through torchao (float8,
train.precision=fp8)."""
