"""Stand-ins for the pieces of TorchNeuron a CPU machine lacks (put this folder first on PYTHONPATH).

``torch_neuronx`` here follows TorchNeuron's own source for the device, the ``neuron`` process group and the
NEFF cache, each rule citing its line (tests/neuron_standin/torch_neuronx). ``report_core`` is a trainer
stand-in that joins the process group as a trainer does and writes which core its rank holds.
"""
