"""Stand-ins for the pieces of TorchNeuron a CPU machine lacks (put this folder first on PYTHONPATH).

``torch_neuronx`` here does only what the launch tests need of the real one: on import it applies
TorchNeuron's rule for the NeuronCores a process holds and reserves them as the Neuron runtime does.
``report_core`` is a trainer stand-in that imports it and writes which core its rank holds.
"""
