"""The model zoo and the folder formats every stage shares; the first import of torchvision in a
process that uses them skips TorchDynamo (:mod:`models.torchvision_import`)."""

from models.torchvision_import import import_torchvision_without_dynamo

import_torchvision_without_dynamo()
