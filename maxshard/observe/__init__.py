"""What a run tells its user: metrics files and TensorBoard, the console lines, the layout report, profiling and
the MFU arithmetic."""
